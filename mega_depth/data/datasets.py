"""Datasets through megatron-core's BlendedMegatronDatasetBuilder (mock data now; indexed data plugs in here)."""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

from mega_depth.config import Config


def build_train_dataset(cfg: Config, num_samples: int):
    """The training split. With --mock-data: Megatron's MockGPTDataset over ids < vocab_size - 1 (EOD last)."""
    if not cfg.training.mock_data:
        raise NotImplementedError("only --mock-data is wired in this build; pass --mock-data")
    tokenizer = NullTokenizer(cfg.model.vocab_size - 1)
    ds_cfg = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        split="1,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    builder = BlendedMegatronDatasetBuilder(MockGPTDataset, [num_samples, 0, 0], lambda: True, ds_cfg)
    return builder.build()[0]


class GlobalBatchSampler:
    """Deterministic sample order, independent of the parallel layout.

    Global batch `step` holds samples [step * gbs, (step + 1) * gbs); micro-batch m of data-parallel rank r holds
    the mbs samples starting at step * gbs + (m * dp + r) * mbs. Every layout with the same global batch sees
    the same samples in each step, and resuming at `step` continues the same order.
    """

    def __init__(self, dataset, micro_batch_size: int, num_microbatches: int, dp_size: int, dp_rank: int):
        self.dataset = dataset
        self.mbs, self.nmb, self.dp, self.dp_rank = micro_batch_size, num_microbatches, dp_size, dp_rank

    @property
    def global_batch_size(self) -> int:
        return self.mbs * self.nmb * self.dp

    def microbatches(self, step: int) -> List[dict]:
        out = []
        for m in range(self.nmb):
            start = step * self.global_batch_size + (m * self.dp + self.dp_rank) * self.mbs
            samples = [self.dataset[i % len(self.dataset)] for i in range(start, start + self.mbs)]
            out.append({k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels",
                                                                                         "loss_mask",
                                                                                         "position_ids")})
        return out
