"""The dropout flags reach the plain decoder (what the XLA trainer and the Hugging Face export run) and act in
training only: --attention-dropout on the attention probabilities, --hidden-dropout on each sublayer's output."""

import pytest
import torch

from fixtures import UNIT_MODEL
from mega_depth.config import parse_args
from mega_depth.init import padded_vocab_size
from mega_depth.model.decoder import CausalLM


def model_with(*flags: str) -> CausalLM:
    cfg = parse_args(UNIT_MODEL + list(flags))
    torch.manual_seed(0)
    return CausalLM(cfg.decoder_config(padded_vocab_size(cfg.model.vocab_size)))


@pytest.mark.parametrize("flag", ["--attention-dropout", "--hidden-dropout"])
def test_a_dropout_flag_acts_in_training_and_not_in_evaluation(flag):
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    plain, dropped = model_with(), model_with(flag, "0.5")
    assert getattr(dropped.cfg, flag[2:].replace("-", "_")) == 0.5
    dropped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        reference = plain.eval()(ids)
        torch.testing.assert_close(dropped.eval()(ids), reference, rtol=0, atol=0)
        dropped.train()
        torch.manual_seed(2)
        first = dropped(ids)
        torch.manual_seed(2)
        assert torch.equal(dropped(ids), first)  # drawn from the default generator: a restored RNG repeats it
        assert not torch.allclose(first, reference, atol=1e-3)
