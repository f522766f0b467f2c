"""The sentencepiece tokenizer, with what megatron-core's GPT datasets read from one (vocab_size, eod,
unique_identifiers); encoding happens in tools/preprocess_data.py, decoding in the Hugging Face export."""

from __future__ import annotations

import os
from collections import OrderedDict

import sentencepiece as spm


class SentencePieceTokenizer:
    """Llama-style sentencepiece model: <unk>=0, <s>=1 (BOS), </s>=2 (EOS, also the end-of-document token)."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model {model_path} does not exist; train one with "
                                    "tools/train_tokenizer.py")
        self.model_path = model_path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{model_path} is not a sentencepiece model: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self.sp.eos_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": type(self).__name__, "model": os.path.abspath(self.model_path)})
