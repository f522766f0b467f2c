"""What the routers of an MoE model did over a logging interval: tokens per expert per layer, and the
load-balancing loss per layer.

Tokens are counted on device by forward hooks on Megatron's routers (training forwards with grad only: not in
evaluation, probes, or the no-grad first pass of a recomputed layer), before dispatch, so each token counts once on
the rank that holds it (with TP, Megatron's MoE needs SP: every rank holds its own tokens). The losses are the ones
Megatron's routers record per micro-batch (moe_utils' layer-wise tracker; aux loss / coeff). `read` reduces both
over every rank (SUM: layers live on one stage, tokens on one rank; the losses' TP/CP parts add up and their DP
replicas are averaged) and starts the next interval.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class RoutingMetrics:
    def __init__(self, chunks, num_layers: int, num_experts: int, moe_layers: List[int], loss_name,
                 device: torch.device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.moe_layers, self.loss_name = moe_layers, loss_name  # loss_name: None when no loss is on
        self.num_layers = num_layers
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.microbatches = 0
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    @classmethod
    def for_model(cls, cfg, chunks, device: torch.device) -> Optional["RoutingMetrics"]:
        """The metrics of `chunks` (this rank's model chunks) under the run config `cfg`; None for a dense model."""
        dc, m = cfg.decoder_config(), cfg.model
        if not dc.num_experts:
            return None
        loss = TRACKED.get(m.moe_router_load_balancing_type) if m.moe_aux_loss_coeff else None
        moe_layers = [i for i in range(dc.num_layers) if dc.is_moe_layer(i)]
        return cls(chunks, dc.num_layers, dc.num_experts, moe_layers, loss, device)

    def _count(self, router, inputs, output):
        if router.training and torch.is_grad_enabled():
            _, routing_map = output
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0)

    def add_microbatches(self, n: int) -> None:
        self.microbatches += n

    def read(self) -> Dict[str, Dict[int, object]]:
        """Collective. {"tokens_per_expert": {layer: [E counts]}, "load_balancing_loss": {layer: mean loss}}."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, \
            get_moe_layer_wise_logging_tracker

        counts = self.counts.clone()
        torch.distributed.all_reduce(counts)
        out = {"tokens_per_expert": {i: counts[i].tolist() for i in self.moe_layers}}
        if self.loss_name is not None:
            tracked = get_moe_layer_wise_logging_tracker().get(self.loss_name)
            values = torch.zeros(self.num_layers, dtype=torch.float64, device=counts.device)
            if tracked is not None:  # a stage with only dense layers records nothing
                values += tracked["values"].double()[: self.num_layers]
            torch.distributed.all_reduce(values)
            values /= parallel_state.get_data_parallel_world_size() * max(self.microbatches, 1)
            out["load_balancing_loss"] = {i: values[i].item() for i in self.moe_layers}
        self.counts.zero_()
        self.microbatches = 0
        clear_aux_losses_tracker()
        return out
