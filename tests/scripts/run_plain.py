"""Train every mechanism with the plain trainer (mega_depth.xla.train) on run_layout.py's model and data, in one
process; write OUT/<mechanism>/losses.json. Extra arguments go to the trainer (--device cpu, --mesh 2,1, ...).

    python tests/scripts/run_plain.py OUT --device cpu          (tests/integration/test_layouts.py, vs Megatron)
    PJRT_DEVICE=CPU python tests/scripts/run_plain.py OUT ...   (tests/xla, under torch-xla)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixtures import LAYOUT_MODEL, mechanism_flags  # noqa: E402


def main() -> None:
    out, extra = sys.argv[1], sys.argv[2:]
    from mega_depth.xla.train import main as train_main

    only = os.environ.get("MECHANISMS")
    for name, flags in mechanism_flags(4).items():
        if only and name not in only.split(","):
            continue
        run_dir = os.path.join(out, name)
        status = train_main(LAYOUT_MODEL + flags + extra + ["--output-dir", run_dir, "--no-tensorboard"])
        if status != 0:
            raise SystemExit(f"{name}: the plain trainer exited with {status}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f]
        with open(os.path.join(run_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
