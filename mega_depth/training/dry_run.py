"""--dry-run: the start-up summary and the largest rank's memory estimate, in one process, for any size and layout.

Nothing is built for real and no process group starts: the model is the plain decoder on the meta device (the same
parameters as the Megatron model: tests/integration/test_megatron_model.py), and each parameter is placed on the
ranks as Megatron places it (`parameters_per_stage`). So the 7B config at its TP x PP = 8 layout is sized in
seconds on a laptop; launched under torchrun, the same estimate is printed by rank 0 alone.
"""

from __future__ import annotations

import math
import re
from typing import Callable, List

from mega_depth.config import Config

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def layout_world(cfg: Config, world_size: int) -> int:
    """The world the estimate is for: the launched one, or in one process the smallest the layout needs: a stage's
    ranks are a multiple of TP x CP (DP 1 where experts need no more) and of EP x expert TP (the experts spread
    inside data parallelism, as Megatron lays them)."""
    p = cfg.parallel
    stage = math.lcm(p.tensor_model_parallel_size * p.context_parallel_size,
                     p.expert_model_parallel_size * (p.expert_tensor_parallel_size or p.tensor_model_parallel_size))
    return max(world_size, stage * p.pipeline_model_parallel_size)


def parameters_per_stage(cfg: Config, vocab_size: int) -> List[int]:
    """Parameters one rank of each pipeline stage holds. A layer sits on the stage of its chunk (interleaved: chunk
    c on stage c mod PP); the embedding on the first stage, the final norm, the mechanism's final modules and the
    output layer on the last (with tied embeddings and PP > 1, the last stage keeps its own copy, as Megatron's
    shared embedding does). Linear weights and the vocabulary are split over TP, experts over EP and their linear
    weights over expert TP; norms, routers and the mixing parameters are replicated."""
    import torch

    from mega_depth.model.decoder import CausalLM

    p = cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    per_chunk = cfg.model.num_layers // (pp * (cfg.virtual_pipeline_size or 1))
    with torch.device("meta"):
        model = CausalLM(cfg.decoder_config(vocab_size))
    stages = [0.0] * pp
    for name, param in model.named_parameters():  # tied weights appear once
        n = param.numel()
        if _EXPERT.search(name):
            n = n / ep / etp if name.endswith("_proj.weight") else n / ep
        elif name.endswith("_proj.weight") or "embed_tokens" in name or "lm_head" in name:
            n = n / tp
        layer = _LAYER.match(name)
        if layer:
            stages[(int(layer.group(1)) // per_chunk) % pp] += n
        elif "embed_tokens" in name:
            stages[0] += n
            if pp > 1 and model.cfg.tie_word_embeddings:
                stages[-1] += n
        else:
            stages[-1] += n
    return [int(s) for s in stages]


def _zero_stage(cfg: Config) -> int:
    if not cfg.training.deepspeed or not cfg.training.deepspeed_config:
        return 0
    from mega_depth.training.backends.deepspeed import read_ds_config

    return int(read_ds_config(cfg.training.deepspeed_config).get("zero_optimization", {}).get("stage", 0))


def dry_run(cfg: Config, world_size: int, say: Callable[[str], None] = print) -> None:
    """Print the summary and the memory estimate of the rank that needs the most; write nothing."""
    from mega_depth.checkpoint import rules
    from mega_depth.data.datasets import training_tokens
    from mega_depth.init import padded_vocab_size
    from mega_depth.training import report
    from mega_depth.training.trainer import evaluates

    p = cfg.parallel
    vocab = padded_vocab_size(cfg.model.vocab_size)
    dp = cfg.data_parallel_size(world_size)
    found = rules.peek_metadata(cfg.checkpoint.load) if cfg.checkpoint.load else None
    start = 0 if found is None or found[1].get("model_only") else int(found[1]["step"])
    counts = report.model_counts(cfg, vocab)
    layout = {"tp": p.tensor_model_parallel_size, "cp": p.context_parallel_size,
              "pp": p.pipeline_model_parallel_size, "dp": dp}
    sampler_shape = (cfg.training.micro_batch_size, cfg.num_microbatches(world_size), dp, 0)
    for line in report.summary_lines(cfg, counts, layout, sampler_shape, world_size, training_tokens(cfg), start,
                                     evaluates(cfg)):
        say(line)
    stages = parameters_per_stage(cfg, vocab)
    # the depth state the mechanism carries past its last layer, in units of d per token (pipeline.py's payload)
    state = cfg.decoder_config().mechanism().layout(cfg.model.num_layers)
    units = sum(e.width for e in state) / cfg.model.hidden_size
    estimates = [report.memory_estimate(cfg, n, dp, _zero_stage(cfg), units, world_size) for n in stages]
    stage, peak = max(enumerate(estimates), key=lambda e: e[1].total)
    for line in report.memory_lines(peak):
        say(line + (f" [pipeline stage {stage}, the largest of {len(stages)}]" if len(stages) > 1 else ""))
    say("--dry-run: sized on the meta device (nothing allocated); no step taken, nothing written")
