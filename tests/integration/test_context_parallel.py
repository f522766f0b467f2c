"""Context parallelism beyond the layout matrix (tests/integration/test_layouts.py has its exactness): the data
split agrees with Megatron's RoPE split, and each rank keeps half the attention activations at CP2."""

import json
import os

import pytest
import torch

from fixtures import SCRIPTS, torchrun
from mega_depth.megatron.context_parallel import _natural_order, chunk_ids, split_batch


class _Group:
    """The two methods of a process group that Megatron's RoPE split reads."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_data_split_is_megatrons_load_balanced_one_and_rope_follows_it(cp):
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    from mega_depth.megatron import cpu_compat

    cpu_compat.apply()
    s, b = 8 * cp, 3
    tokens = torch.arange(b * s).reshape(b, s)
    positions = torch.arange(s).expand(b, s)
    parts = [split_batch({"tokens": tokens, "position_ids": positions}, cp, r) for r in range(cp)]
    chunk = s // (2 * cp)
    for rank, part in enumerate(parts):
        # chunks r and 2 CP - 1 - r: the same causal work on every rank
        expect = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp, rank)])
        assert torch.equal(part["position_ids"][0], expect)
        assert torch.equal(part["tokens"], tokens[:, expect])
        if cp > 1:  # Megatron's RoPE picks the same positions on this rank
            rope = get_pos_emb_on_this_cp_rank(torch.arange(s, dtype=torch.float).reshape(s, 1, 1, 1), 0,
                                               _Group(cp, rank))
            assert torch.equal(rope.flatten().long(), expect)
    # the gathered rank-major chunks, reordered, are the whole sequence
    gathered = torch.cat([p["position_ids"][0] for p in parts]).reshape(2 * cp, chunk)
    assert torch.equal(gathered[_natural_order(cp)].flatten(), torch.arange(s))


def test_cp2_keeps_half_the_attention_activations_per_rank(tmp_path):
    """At the same micro-batch, a CP2 rank saves for backward about half of what a CP1 rank saves, in the core
    attention (only the local K and V shards are kept: backward gathers them again) and in the whole step."""
    out = tmp_path / "saved.json"
    torchrun(2, [os.path.join(SCRIPTS, "run_cp_memory.py"), str(out)], str(tmp_path / "memory.log"))
    saved = json.loads(out.read_text())
    for mechanism, by_cp in saved.items():
        attention = by_cp["cp2"]["attention"] / by_cp["cp1"]["attention"]
        total = by_cp["cp2"]["total"] / by_cp["cp1"]["total"]
        assert 0.45 < attention < 0.55, (mechanism, by_cp)
        assert 0.45 < total < 0.55, (mechanism, by_cp)
