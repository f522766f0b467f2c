"""Export a mega_depth checkpoint (any trainer, any TP/PP/DP layout) to a Hugging Face folder, fully offline.

    python tools/convert_to_hf.py --load runs/tiny-attnres/checkpoints --out runs/tiny-attnres/hf [--dtype bf16]

Standard-residual models become native Qwen3/Llama folders; depth-mixing models load with
AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True). The checkpoint is verified against its
manifest first (a save folder falls back to its newest intact checkpoint).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="a --save directory (latest checkpoint) or one iter_N dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="fp32", help="fp32 or bf16")
    parser.add_argument("--tokenizer-model", default=None, help="defaults to the one the checkpoint recorded")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)

    from mega_depth.config import ConfigError
    from mega_depth.hf.io import export_checkpoint
    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()
    try:
        out = export_checkpoint(args.load, args.out, args.dtype, args.force, args.tokenizer_model, args.max_shard_size,
                                say=lambda msg: print(msg, file=sys.stderr))
    except ConfigError as e:
        print(f"convert_to_hf: {e}", file=sys.stderr)
        return 2
    import json

    config = json.load(open(os.path.join(out, "config.json")))
    remote = "auto_map" in config  # a depth-mixing export ships its own model code
    print(f"exported {args.load} to {out}: {', '.join(config.get('architectures', []))} (model_type "
          f"{config.get('model_type')}; load with AutoModelForCausalLM"
          + (", trust_remote_code=True" if remote else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
