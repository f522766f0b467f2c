"""Padded batches on the plain decoder (what the Hugging Face export runs), for every catalogue setting: left and
right padding give the unpadded logits at the real positions, an all-ones mask is the unpadded computation bit for
bit, no pad goes NaN, and the KV cache decodes a left-padded batch as the full forward does."""

import pytest
import torch

from mega_depth.catalogue import SETTINGS, residual_settings
from mega_depth.model.config import DecoderConfig, ResidualConfig
from mega_depth.model.decoder import CausalLM, padding_mask
from mega_depth.model.registry import owner_of

LAYERS = 4
LENGTHS = (7, 3, 5)


def model_of(name: str) -> CausalLM:
    """A plain model of a catalogue setting with its mixing parameters off their initialisation."""
    residual = ResidualConfig(**residual_settings(name, LAYERS, attnres_num_blocks=3))
    torch.manual_seed(0)
    model = CausalLM(DecoderConfig(vocab_size=64, hidden_size=32, num_layers=LAYERS, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=64, residual=residual))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if owner_of(n):
                p.add_(0.3 * torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() >= 2 else 1.0))
            elif p.dim() >= 2:
                p.normal_(0, 0.1)
    return model.eval()


class Cache:
    """The decoder's cache interface (Hugging Face's DynamicCache has the same two methods)."""

    def __init__(self):
        self.keys, self.values = {}, {}

    def update(self, k, v, layer):
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], 2), torch.cat([self.values[layer], v], 2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def get_seq_length(self):
        return self.keys[0].shape[2] if self.keys else 0


def padded(prompts, side: str, pad: int = 2):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        where = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, where], mask[i, where] = p, 1
    return ids, mask


def prompts_of(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("name", SETTINGS)
def test_padded_logits_equal_unpadded_ones_and_an_all_ones_mask_changes_nothing(name):
    model = model_of(name)
    prompts = prompts_of()
    width = max(LENGTHS)
    with torch.no_grad():
        alone = [model(p[None])[0] for p in prompts]
        ones = torch.ones(1, len(prompts[0]), dtype=torch.long)
        assert torch.equal(model(prompts[0][None], attention_mask=ones), model(prompts[0][None]))
        for side in ("left", "right"):
            ids, mask = padded(prompts, side)
            logits = model(ids, attention_mask=mask)
            assert torch.isfinite(logits).all(), side  # pads included: a left pad attends to itself
            for i, n in enumerate(LENGTHS):
                real = slice(width - n, width) if side == "left" else slice(0, n)
                torch.testing.assert_close(logits[i, real], alone[i], rtol=0, atol=1e-5)


def decode(model, ids, mask, nxt):
    """Logits of a prefill of `ids` and then `nxt` one token at a time through the KV cache, the mask (if any) over
    the cached and current tokens as Hugging Face's generate passes it."""
    cache = Cache()
    steps = [model(ids, cache=cache, attention_mask=mask)]
    for t in range(nxt.shape[1]):
        step_mask = None if mask is None else torch.cat([mask, torch.ones_like(nxt[:, :t + 1])], 1)
        steps.append(model(nxt[:, t:t + 1], cache=cache, attention_mask=step_mask))
    return torch.cat(steps, 1)


@pytest.mark.parametrize("name", SETTINGS)
def test_kv_cache_decodes_a_left_padded_batch_as_each_prompt_alone_and_as_the_full_forward(name):
    model = model_of(name)
    prompts = prompts_of(2)
    ids, mask = padded(prompts, "left")
    nxt = torch.randint(3, 64, (len(LENGTHS), 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batched = decode(model, ids, mask, nxt)
        for i, p in enumerate(prompts):
            alone = decode(model, p[None], None, nxt[i:i + 1])[0]
            # fp32 rounding of other batch shapes (the input-dependent query's per-token projection: ~1.5e-5)
            torch.testing.assert_close(batched[i, -alone.shape[0]:], alone, rtol=0, atol=5e-5)
        full = model(torch.cat([ids, nxt], 1), attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1))
    # decoding vs one forward differs in summation order only (up to ~2e-5 for the input-dependent query, unpadded
    # as well)
    torch.testing.assert_close(batched, full, rtol=0, atol=1e-4)


def test_padding_mask_keeps_every_query_its_own_key_and_counts_real_positions():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    allowed, positions = padding_mask(mask, 4, 0)
    assert positions.tolist() == [[0, 0, 0, 1], [0, 1, 2, 2]]
    assert allowed.shape == (2, 1, 4, 4) and allowed.any(-1).all()
    assert allowed[0, 0].tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert allowed[1, 0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert padding_mask(torch.ones(2, 5), 2, 3) == (None, None)  # nothing padded: the unpadded path
    allowed, positions = padding_mask(torch.tensor([[0, 1, 1]]), 1, 2)  # a decode step after 2 cached tokens
    assert allowed[0, 0].tolist() == [[0, 1, 1]] and positions.tolist() == [[1]]
    with pytest.raises(ValueError, match="cached \\+ current"):
        padding_mask(torch.tensor([[0, 1]]), 1, 2)
