"""Train a sentencepiece tokenizer (BPE, byte fallback) from text / jsonl / parquet files.

    python tools/train_tokenizer.py --input corpus.jsonl.gz --vocab-size 8000 --output-prefix tok/spm

Writes P.model and P.vocab. Llama-style settings (identity normalisation, byte fallback, digits split, no
whitespace squashing) so that Hugging Face's tokenizers reproduce the ids exactly.
"""

import argparse
import os
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

    try:
        dataset = load_text_dataset(args.input, args.json_keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=(row["text"] for row in dataset),
        model_prefix=args.output_prefix,
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
    print(f"wrote {args.output_prefix}.model ({args.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
