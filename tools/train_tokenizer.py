"""Train a sentencepiece tokenizer (BPE, byte fallback) from text / jsonl / parquet files.

    python tools/train_tokenizer.py --input corpus.jsonl.gz --vocab-size 8000 --output-prefix tok/spm

Writes P.model and P.vocab. Llama-style settings (identity normalisation, byte fallback, digits split, no
whitespace squashing) so that Hugging Face's tokenizers reproduce the ids exactly.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mega_depth.data.text import load_text_dataset  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True, help="text (one document per line), jsonl or parquet")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--max-sentences", type=int, default=2_000_000, help="documents sampled for training")
    args = parser.parse_args(argv)

    import sentencepiece as spm

    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()

    try:
        dataset = load_text_dataset(args.input, args.json_keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 2
    if args.vocab_size < 8:
        print(f"train_tokenizer: --vocab-size {args.vocab_size} is too small; give at least 8 (the special tokens "
              "and some pieces)", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    tmp = args.output_prefix + ".tmp"  # written under a temporary name, renamed when complete
    try:
        _train(spm, dataset, tmp, args)
    except RuntimeError as e:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        limit = re.search(r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if limit:
            print(f"train_tokenizer: --vocab-size {limit.group(1)} is too large for this text: sentencepiece can make "
                  f"at most {limit.group(2)} pieces from it; lower --vocab-size or give more text", file=sys.stderr)
        elif re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e)):
            small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e))
            print(f"train_tokenizer: --vocab-size {small.group(1)} is too small for this text, which needs "
                  f"{small.group(2)} pieces for its characters alone; raise --vocab-size", file=sys.stderr)
        else:
            print(f"train_tokenizer: sentencepiece failed: {str(e).splitlines()[-1][:300]}", file=sys.stderr)
        return 2
    for ext in (".model", ".vocab"):
        os.replace(tmp + ext, args.output_prefix + ext)
    print(f"wrote {args.output_prefix}.model ({args.vocab_size} pieces)")
    return 0


def _train(spm, dataset, prefix: str, args) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=(row["text"] for row in dataset),
        model_prefix=prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=1.0,
        input_sentence_size=args.max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=1 << 16,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )


if __name__ == "__main__":
    sys.exit(main())
