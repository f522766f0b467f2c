"""Host-device syncs in one training step of every mechanism: the step must make none but its loss read.

    python tools/sync_check.py [--mechanisms a,b] [--hidden-size 512 --num-layers 4 --seq-length 512] [--out f.json]

On a GPU: after a warm-up step (allocations, Triton's compilation), forward and backward run under
torch.cuda.set_sync_debug_mode("error"): any sync raises and is reported with its stack; the loss read is marked
intended (mega_depth/training/host_sync.py) and lifts the mode for itself. The optimizer step runs under "warn"
and its syncs are counted: Megatron's optimizer reads the gradient norm to the host (clip_grads.py), as
Megatron-LM does. On a CPU the same step runs under host_sync.SyncDetector, which finds the calls of mega_depth's
own code that would sync on a GPU. Exits 1 if a forward/backward made a sync.
"""

import argparse
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_model_args, model_flags  # noqa: E402
from mega_depth.catalogue import SETTINGS, parse_mechanisms  # noqa: E402


def check_gpu(backend, microbatches) -> dict:
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward_backward(microbatches)
        result = {"forward_backward_syncs": []}
    except RuntimeError as exc:  # the sync debug mode's error, raised where the sync happened
        result = {"forward_backward_syncs": [f"{exc}\n{''.join(traceback.format_tb(exc.__traceback__)[-4:])}"]}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    result["optimizer_syncs"] = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return result


def check_cpu(backend, microbatches) -> dict:
    from mega_depth.training.host_sync import SyncDetector

    with SyncDetector() as found:
        backend.forward_backward(microbatches)
    with SyncDetector() as found_update:
        backend.update()
    return {"forward_backward_syncs": [str(s) for s in found], "optimizer_syncs": [str(s) for s in found_update]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mechanisms", default=",".join(SETTINGS))
    add_model_args(parser, hidden_size=512, seq_length=512)
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args(argv)

    import torch

    from harness import megatron_run, start, train_step

    start()
    gpu = torch.cuda.is_available()
    results = {}
    for name in parse_mechanisms(args.mechanisms):
        flags = model_flags(args, name, 4, gpu, extra)
        backend, sampler = megatron_run(flags, 64)
        train_step(backend, sampler.microbatches(0))  # warm-up: allocations, Triton's compilation
        results[name] = (check_gpu if gpu else check_cpu)(backend, sampler.microbatches(1))
        backend.close()
        found = results[name]["forward_backward_syncs"]
        print(f"{name}: {'no sync' if not found else f'{len(found)} sync(s)'} in forward/backward, "
              f"{len(results[name]['optimizer_syncs'])} in the optimizer step", flush=True)
        for s in found:
            print("   ", s.splitlines()[0])
        if args.out:  # after every setting: a run cut short by its time box keeps what it finished
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "results": results}, f,
                          indent=1)
    torch.distributed.destroy_process_group()
    return 1 if any(r["forward_backward_syncs"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
