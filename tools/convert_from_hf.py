"""Import a Hugging Face folder (a mega_depth export, or a native Qwen3/Llama model) or any mega_depth checkpoint
as a weights-only mega_depth checkpoint, which every trainer (--load) fine-tunes from in any layout.

    python tools/convert_from_hf.py --hf runs/tiny-attnres/hf --save runs/imported
    python tools/convert_from_hf.py --hf runs/xla/checkpoints --save runs/from-xla   # another trainer's checkpoint
    python -m mega_depth.train --config ... --load runs/imported      # fine-tune from it (fresh optimizer, step 0)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hf", required=True, help="Hugging Face model folder, or a mega_depth checkpoint")
    parser.add_argument("--save", required=True, help="checkpoint directory to write (iter_0000000 inside)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --save")
    args = parser.parse_args(argv)

    from mega_depth.config import ConfigError
    from mega_depth.hf.io import import_folder
    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()
    try:
        path = import_folder(args.hf, args.save, args.force, say=lambda msg: print(msg, file=sys.stderr))
    except ConfigError as e:
        print(f"convert_from_hf: {e}", file=sys.stderr)
        return 2
    print(f"imported {args.hf} as {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
