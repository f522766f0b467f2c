"""Print a sample from an exported Hugging Face folder, offline, with transformers.

    python tools/generate.py runs/tiny-attnres/hf --prompt "The Python tutorial" [--max-new-tokens 60]

The prompt and the continuation are decoded together: sentencepiece drops the leading space of a piece decoded on
its own, so decoding the continuation alone would glue its first word to the prompt.
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.folder, trust_remote_code=True).eval()
    kwargs = dict(do_sample=True, temperature=0.8, top_k=40) if args.sample else dict(do_sample=False,
                                                                                      repetition_penalty=1.3)
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, **kwargs)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    print("\n--- sample " + "-" * 60)
    print(text)
    print("-" * 71)
    return 0


if __name__ == "__main__":
    sys.exit(main())
