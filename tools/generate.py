"""Print a sample from an exported Hugging Face folder, offline, with transformers' text-generation pipeline.

    python tools/generate.py runs/tiny-attnres/hf --prompt "The Python tutorial" [--max-new-tokens 60]
"""

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--prompt", default="The Python tutorial")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-k 40) instead of greedy")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import pipeline

    torch.manual_seed(0)
    generator = pipeline("text-generation", model=args.folder, tokenizer=args.folder, trust_remote_code=True)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=40) if args.sample else dict(do_sample=False,
                                                                                      repetition_penalty=1.3)
    text = generator(args.prompt, max_new_tokens=args.max_new_tokens, **kwargs)[0]["generated_text"]
    print("\n--- sample " + "-" * 60)
    print(text)
    print("-" * 71)
    return 0


if __name__ == "__main__":
    sys.exit(main())
