"""Training data through megatron-core: indexed datasets (.bin/.idx) blended and split by
BlendedMegatronDatasetBuilder into GPTDatasets, or Megatron's MockGPTDataset with --mock-data."""

from __future__ import annotations

import hashlib
import math
import os
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from mega_depth.checkpoint.manifest import file_sha256
from mega_depth.config import Config, ConfigError

_IDX_MAGIC = b"MMIDIDX\x00\x00"


def check_indexed_dataset(prefix: str, vocab_size: Optional[int]) -> None:
    """Fail early and clearly on a missing, truncated or foreign .bin/.idx pair, or one made with a bigger
    vocabulary than the model's (that would silently train on wrapped-around ids)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise ConfigError(f"data file {path} does not exist; build {prefix}.bin/.idx with tools/preprocess_data.py "
                              "(--data-path takes the prefix, without .bin/.idx)")
    with open(idx, "rb") as f:
        header = f.read(9 + 8 + 1 + 8 + 8)
    if len(header) < 34 or header[:9] != _IDX_MAGIC:
        raise ConfigError(f"{idx} is not a Megatron indexed-dataset index (bad header); rebuild it with "
                          "tools/preprocess_data.py")
    dtype_code = header[17]
    num_sequences, num_documents = struct.unpack("<QQ", header[18:34])
    # sequence lengths (int32), sequence pointers and document indices (int64) follow the header
    if os.path.getsize(idx) < 34 + 12 * num_sequences + 8 * num_documents:
        raise ConfigError(f"{idx} is truncated ({os.path.getsize(idx)} bytes, its header describes "
                          f"{num_sequences} sequences); rebuild it with tools/preprocess_data.py")
    from megatron.core.datasets.indexed_dataset import DType

    try:
        dtype = DType.dtype_from_code(dtype_code)
    except (KeyError, ValueError):
        raise ConfigError(f"{idx} names an unknown token dtype code {dtype_code}; rebuild it") from None
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(num_sequences,))
    expected = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ConfigError(f"{bin_} holds {actual} bytes but {idx} describes {expected}: the pair is truncated or "
                          "mismatched; rebuild both with tools/preprocess_data.py")
    if vocab_size is not None and actual:
        tokens = np.memmap(bin_, dtype=dtype, mode="r")
        sample = tokens[: 1 << 24]  # the first 16M tokens are enough to catch a foreign tokenizer
        top = int(sample.max())
        if top >= vocab_size:
            raise ConfigError(f"{bin_} contains token id {top}, but the tokenizer/model vocabulary has {vocab_size} "
                              "entries: the data was made with another tokenizer; preprocess it with "
                              "--tokenizer-model of this run")


def document_lengths(prefix: str) -> np.ndarray:
    """Tokens per document of an indexed dataset (from its .idx)."""
    idx = prefix + ".idx"
    with open(idx, "rb") as f:
        header = f.read(34)
    num_sequences = struct.unpack("<Q", header[18:26])[0]
    return np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(num_sequences,))


def split_tokens(prefix: str, split: str) -> Dict[str, Tuple[int, int]]:
    """{"training"|"validation"|"test": (tokens, documents)} of an indexed dataset under --split (Megatron's
    document-level split)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    lengths = document_lengths(prefix)
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out = {}
    for name, bound in zip(("training", "validation", "test"), bounds):
        if bound is None:
            out[name] = (0, 0)
            continue
        beg, end = (int(round(b * float(len(lengths)))) for b in bound)
        out[name] = (int(lengths[beg:end].sum(dtype=np.int64)), end - beg)
    return out


def check_split_fits(prefix: str, split: str, seq_length: int, splits=("training", "validation")) -> None:
    """Every split a run samples holds a document and at least one sequence: --seq-length + 1 tokens. Megatron loops
    for ever on a split without documents, and would otherwise build each sample from the split's documents
    repeated many times over (and its sample index grows with the sequence: a runaway allocation for a huge
    --seq-length)."""
    for name, (tokens, documents) in split_tokens(prefix, split).items():
        if name in splits and not documents:  # (megatron would loop for ever filling it)
            hint = " or drop --eval-interval / set --eval-iters 0," if name == "validation" else ""
            raise ConfigError(f"the {name} split of {prefix} holds no document (--split {split} over its "
                              f"{len(document_lengths(prefix))} documents); give that part of --split more weight,"
                              f"{hint} or add data")
        if name in splits and tokens < seq_length + 1:
            raise ConfigError(f"--seq-length {seq_length} needs {seq_length + 1} tokens per sample, but the {name} "
                              f"split of {prefix} holds {tokens} tokens in {documents} documents (--split {split}); "
                              "lower --seq-length, or add data")


def training_tokens(cfg: Config) -> Optional[int]:
    """Tokens in the training split of every --data-path dataset (None with --mock-data)."""
    if cfg.data.mock_data:
        return None
    prefixes, _ = _blend(cfg.data.data_path)
    return sum(split_tokens(prefix, cfg.data.split)["training"][0] for prefix in prefixes)


def validation_fits(cfg: Config) -> bool:
    """Whether the validation split of every dataset holds one sample (mock data always does)."""
    if cfg.data.mock_data:
        return True
    prefixes, _ = _blend(cfg.data.data_path)
    for prefix in prefixes:  # a missing or damaged pair gets its one line here, before the index is read
        check_indexed_dataset(prefix, None)
    return all(split_tokens(p, cfg.data.split)["validation"][0] >= cfg.model.seq_length + 1 for p in prefixes)


def _blend(paths: List[str]) -> Tuple[List[str], Optional[List[float]]]:
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        return get_blend_from_list(paths)
    except (AssertionError, ValueError):
        raise ConfigError("--data-path takes PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...]") from None


def build_datasets(cfg: Config, tokenizer, num_samples: Tuple[Optional[int], Optional[int], Optional[int]]):
    """(train, valid, test) datasets; a split asked for None samples is not built (None), and megatron's index of
    every other split covers one epoch, so that the order of the samples depends on the data and the seed alone,
    not on how many a run asks for: megatron shuffles its document index over all the epochs it builds, so a run
    resumed with a longer --train-iters or another global batch reordered every sample it had trained on.
    GlobalBatchSampler reorders each later epoch. A weighted blend needs its sizes (its mix is drawn for them): its
    order follows the samples asked for, as in Megatron-LM."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    d = cfg.data
    common = dict(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=_cache_folder(d.data_cache_path, None if d.mock_data else d.data_path),
        mid_level_dataset_surplus=0.005,
    )
    weighted = False
    if d.mock_data:
        ds_cfg = GPTDatasetConfig(split="1,1,1", **common)
        cls = _mock_dataset_class()
    else:
        prefixes, weights = _blend(d.data_path)
        weighted = weights is not None
        sampled = ("training",) + (("validation",) if num_samples[1] else ())
        for prefix in prefixes:
            check_indexed_dataset(prefix, tokenizer.vocab_size)
            check_split_fits(prefix, d.split, cfg.model.seq_length, sampled)
        ds_cfg = GPTDatasetConfig(blend=(prefixes, weights), split=d.split, **common)
        cls = GPTDataset
    # a split not asked for is left out of the split matrix (its document range kept for the others): megatron
    # would build it, and a weighted blend would refuse its missing size, a split without documents loop for ever
    ds_cfg.split_matrix = [bounds if n else None for bounds, n in zip(ds_cfg.split_matrix, num_samples)]
    sizes = [(n or 0) if weighted else None for n in num_samples]  # (a weighted blend: a size for every split)
    rank0_first = d.data_cache_path is not None and torch.distributed.is_initialized()
    builder = BlendedMegatronDatasetBuilder(
        cls, sizes, (lambda: torch.distributed.get_rank() == 0) if rank0_first else (lambda: True), ds_cfg)
    if rank0_first:  # rank 0 writes the index cache, the others read it
        datasets = builder.build() if torch.distributed.get_rank() == 0 else None
        torch.distributed.barrier()
        if datasets is None:
            datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, ds_cfg).build()
        return datasets
    return builder.build()


def _cache_folder(root: Optional[str], data_path: Optional[List[str]]) -> Optional[str]:
    """Where megatron caches the sample indexes of this data: under --data-cache-path, in a folder named by a digest
    of every prefix's .idx (the documents' lengths, which the sample indexes follow) and its .bin's size. Megatron
    keys its cache by the path, the sample count and the split, never by the files: a prefix preprocessed again
    (more documents, or as many of other lengths) got the old indexes back, naming samples that are not there any
    more. (Contents, not modification times: every node must find the folder rank 0 wrote, also where each node
    holds its own copy of the data.)"""
    if root is None or not data_path:
        return root
    prefixes, _ = _blend(data_path)
    stamps = []
    for prefix in prefixes:
        try:
            digest = file_sha256(prefix + ".idx")  # ~20 bytes a document: ~20 MB for a million
            size = os.path.getsize(prefix + ".bin")
        except OSError:  # (check_indexed_dataset names it)
            return root
        stamps.append(f"{os.path.abspath(prefix)}:{digest}:{size}")
    return os.path.join(root, hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16])


# Mock documents in one epoch. Megatron's mock corpus holds 100,000 (about 200M tokens): each split's shuffle index then
# spans ~10M samples at a short sequence, ~0.6 s of every rank's start-up. 2,000 documents (~4M tokens) are one epoch,
# each document drawn from the same lengths; a longer run reads later epochs in orders of their own.
MOCK_DOCUMENTS = 2000


def _mock_dataset_class():
    """Megatron's MockGPTDataset over MOCK_DOCUMENTS documents."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset

    class MockDocuments(MockGPTLowLevelDataset):
        size = MOCK_DOCUMENTS

    class SmallMockGPTDataset(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config) -> MockDocuments:
            return MockDocuments(config.tokenizer)

    return SmallMockGPTDataset


class MockTokenizer:
    """What megatron-core's MockGPTDataset needs: a vocabulary size and an end-of-document id (the last id)."""

    def __init__(self, vocab_size: int):
        # Megatron's NullTokenizer holds no more than this; importing it imports transformers (~2.5 s a process)
        self.vocab_size, self.eod = vocab_size, vocab_size - 1
        self.unique_identifiers = {"class": f"{type(self).__module__}.{type(self).__qualname__}"}


class GlobalBatchSampler:
    """Deterministic sample order, independent of the parallel layout.

    The training data is one sequence of samples; a global batch takes the next gbs of them. The batch that
    starts at sample c (the samples consumed so far) holds [c, c + gbs); micro-batch m of data-parallel rank r
    holds the mbs samples starting at c + (m * dp + r) * mbs. Every layout with the same global batch sees the
    same samples in each step, and a checkpoint's data position is the samples it consumed (as Megatron-LM
    counts them), so a run resumed with another global batch size continues right after the last sample trained.
    Past the dataset's end each epoch is read in an order of its own (`index`).
    """

    def __init__(self, dataset, micro_batch_size: int, num_microbatches: int, dp_size: int, dp_rank: int):
        self.dataset = dataset
        self.mbs, self.nmb, self.dp, self.dp_rank = micro_batch_size, num_microbatches, dp_size, dp_rank
        self._permutations: Dict[int, Tuple[int, int]] = {}  # epoch -> (a, b) of its order (index)

    @property
    def global_batch_size(self) -> int:
        return self.mbs * self.nmb * self.dp

    def index(self, sample: int) -> int:
        """The dataset index of the run's sample `sample`: the dataset's own order in the first epoch, then each
        later epoch in an order of its own (an affine permutation j -> (a j + b) mod L, drawn from the epoch's
        number: no table of L entries), so that a second epoch does not replay the first batch by batch."""
        size = len(self.dataset)
        epoch, j = divmod(sample, size)
        if epoch == 0 or size == 1:
            return j
        a, b = self._permutations.get(epoch) or self._permutation(epoch, size)
        return (a * j + b) % size

    def _permutation(self, epoch: int, size: int) -> Tuple[int, int]:
        draw = np.random.RandomState([epoch, size % (1 << 31)])
        while True:
            a = int(draw.randint(1, size))
            if math.gcd(a, size) == 1:
                break
        self._permutations[epoch] = a, int(draw.randint(0, size))
        return self._permutations[epoch]

    def microbatches(self, step: int) -> List[dict]:
        """The global batch of `step` when every earlier step had this batch size."""
        return self.microbatches_from(step * self.global_batch_size)

    def microbatches_from(self, consumed: int) -> List[dict]:
        """The global batch that starts after `consumed` samples: this rank's micro-batches."""
        out = []
        for m in range(self.nmb):
            start = consumed + (m * self.dp + self.dp_rank) * self.mbs
            samples = [self.dataset[self.index(i)] for i in range(start, start + self.mbs)]
            out.append({k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                        for k in ("tokens", "labels", "loss_mask", "position_ids")})
        return out


def tokenizer_for(cfg: Config):
    """The run's tokenizer: the sentencepiece model of --tokenizer-model, or the mock one with --mock-data."""
    if cfg.data.mock_data:
        return MockTokenizer(cfg.model.vocab_size)
    from mega_depth.data.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(cfg.data.tokenizer_model)
