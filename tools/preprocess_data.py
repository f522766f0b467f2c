"""Tokenize text / jsonl / parquet files into Megatron's indexed dataset format (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix data/corpus \\
        --tokenizer-model tok/spm.model --json-keys text --workers 2 --append-eod

Tokenisation is a parallel `datasets` map (progress bar); the writer is megatron-core's IndexedDatasetBuilder.
Files are written under temporary names and renamed at the end, so an interrupted run leaves nothing half-written.
"""

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-model", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    args = parser.parse_args(argv)

    import numpy as np

    from mega_depth.quiet import quiet_known_warnings

    quiet_known_warnings()
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from mega_depth.data.text import load_text_dataset
    from mega_depth.data.tokenizer import SentencePieceTokenizer

    try:
        tokenizer = SentencePieceTokenizer(args.tokenizer_model)
        dataset = load_text_dataset(args.input, args.json_keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"preprocess_data: {e}", file=sys.stderr)
        return 2
    model_path, eod, append = args.tokenizer_model, tokenizer.eod, args.append_eod

    def encode(batch):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=model_path)  # one per worker process
        ids = sp.encode([text or "" for text in batch["text"]])  # (None: a line without the key, an empty text)
        # an empty text stays empty (skipped below), as in Megatron-LM: an EOD alone would be a document of nothing
        return {"ids": [x + [eod] if append and x else x for x in ids]}

    # datasets keys its cache by the function, which holds only the model's path: a tokenizer retrained at the same
    # path would get the old ids back. The key names the model's bytes (and what else the ids depend on).
    with open(model_path, "rb") as f:
        model_hash = hashlib.sha256(f.read()).hexdigest()
    key = f"{dataset._fingerprint}:{model_hash}:{eod}:{append}:empty-skipped"  # (the rule for empty texts, 2026-12-04)
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:32]
    tokenized = dataset.map(encode, batched=True, batch_size=256, num_proc=max(1, args.workers),
                            remove_columns=dataset.column_names, desc="tokenizing", new_fingerprint=fingerprint)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    tmp = args.output_prefix + ".tmp"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    for row in tokenized:
        if not row["ids"]:
            continue
        builder.add_item(torch.tensor(row["ids"], dtype=torch.int64))
        builder.end_document()
        n_docs += 1
        n_tokens += len(row["ids"])
    builder.finalize(tmp + ".idx")
    if n_docs == 0:
        for ext in (".bin", ".idx"):
            os.remove(tmp + ext)
        print(f"preprocess_data: {', '.join(args.input)} tokenized to no tokens at all (every document is empty); "
              "nothing written", file=sys.stderr)
        return 2
    os.replace(tmp + ".bin", args.output_prefix + ".bin")
    os.replace(tmp + ".idx", args.output_prefix + ".idx")
    print(f"wrote {args.output_prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens ({np.dtype(dtype).name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
