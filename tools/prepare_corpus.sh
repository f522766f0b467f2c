#!/usr/bin/env bash
# Tokenizer and indexed dataset for the embedded corpus (Python 3.11 documentation, PSF licence), once:
#   bash tools/prepare_corpus.sh   -> data/processed/spm.model, data/processed/python-docs.{bin,idx}
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CORPUS=data/corpus/python-docs-3.11.jsonl.gz
if [ ! -f data/processed/python-docs.idx ] || [ ! -f data/processed/spm.model ]; then
  echo "== preparing the embedded corpus (Python 3.11 documentation, PSF licence)"
  $PY tools/train_tokenizer.py --input "$CORPUS" --vocab-size 4000 --output-prefix data/processed/spm
  $PY tools/preprocess_data.py --input "$CORPUS" --output-prefix data/processed/python-docs \
    --tokenizer-model data/processed/spm.model --workers 2 --append-eod
fi
