"""Train every mechanism for a few steps in parallel layouts; write losses, step-1 grads and hop widths.

Run under torchrun, all mechanisms of a layout inside one launch (imports and the process group are paid once):
    torchrun --nproc-per-node N tests/scripts/run_layout.py OUT_DIR [layout flags...]
    torchrun --nproc-per-node N tests/scripts/run_layout.py --plan PLAN.json
A plan trains several layouts of N processes one after another in the same launch: a JSON list of
{"out": OUT_DIR, "flags": [layout flags], "mechanisms": "a,b" or null (all)}. Each mechanism builds Megatron's
process groups for its own layout and destroys them after (MegatronBackend.close), as one launch per layout would.
Writes OUT_DIR/<mechanism>/losses.json (rank 0), OUT_DIR/<mechanism>/grads_rank<r>.pt (every rank: full tensors
under global names, experts included), OUT_DIR/<mechanism>/hops_rank<r>.json (hop widths and bytes) and
OUT_DIR/<mechanism>/compiled.json (rank 0: layers compiled whole by --compile-layers, graphs Dynamo has captured in
the process so far (a later mechanism or layout may reuse the graphs of an earlier one), and the graph breaks Dynamo
met while this mechanism trained) and OUT_DIR/<mechanism>/fused_paths.json (rank 0: calls of the fused norm's remade
paths), OUT_DIR/<mechanism>/attention_calls.json (rank 0: calls of the core attention in step 1, forward and
recomputation; null for compiled layers), and OUT_DIR/<mechanism>/groups_after_close.json (rank 0, once the backend
has closed: the process groups the process holds, its OS threads and the build's number in the process).
MECHANISMS=a,b limits the mechanisms of a single layout.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fixtures import LAYOUT_MODEL, last_value, mechanism_flags  # noqa: E402


def _gather_tp(t: torch.Tensor, param, expert: bool) -> torch.Tensor:
    """This rank's TP shard -> the full tensor (the inverse of the builder's sharding); a routed expert's weight is
    sharded over the expert-TP group."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    if not getattr(param, "tensor_model_parallel", False) or group is None or group.size() == 1:
        return t
    tp = group.size()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [p.chunk(stride, dim=dim) for p in parts]  # pieces[rank][k]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def full_grads(modules, cfg) -> dict:
    """{global name: full grad} for this rank's pipeline stages and experts (collective over TP and expert TP)."""
    from mega_depth.megatron.builder import first_local_expert, global_param_name, is_expert_param

    out = {}
    first_expert = first_local_expert(cfg)
    for module in modules:
        first_layer = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
        for name, param in module.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = grad if grad is not None else param.grad
            if grad is None:
                continue
            name = global_param_name(name, first_layer, first_expert)
            # clone: main_grad is a view into a buffer that the next step overwrites
            out[name] = _gather_tp(grad.detach().float(), param, is_expert_param(name)).cpu().clone()
    return out


class _FusedPaths:
    """Counts, per mechanism, the calls of the fused norm's paths that keep what makes a sublayer input instead of
    the input (they run where the fused norm does: a GPU, or here Liger's norm under Triton's interpreter with
    FUSED_NORM_INTERPRETED=1), and of the fused mixing's deferred source gradients (any --mixing-impl triton)."""

    def __init__(self):
        from mega_depth.kernels import attnres_block, attnres_mix, depth_attention, streams
        from mega_depth.megatron import norm
        from mega_depth.megatron.qkv_projection import RemadeQKVProjection

        self.counts = {}
        for key, cls in (("remade_qkv", RemadeQKVProjection), ("remade_norm", norm._RemadeNorm)):
            cls.forward = staticmethod(self._counted(key, cls.forward))
        norm._outputs_made_again = self._counted("made_again", norm._outputs_made_again)
        # the ops that make a sublayer input and normalise it in one (a `Recomputed`'s `normalised`)
        attnres_block.attnres_phase2_normed = self._counted("normalised", attnres_block.attnres_phase2_normed)
        streams.streams_in_normed = self._counted("normalised", streams.streams_in_normed)
        # Depth-Attention's value mix with the layer's query and key norms folded in (its raw query and key and the
        # candidates' raw keys normalised in the op), or the key norm alone (the candidates')
        depth_attention.depth_attention_mix_qk_normed = self._counted("folded",
                                                                      depth_attention.depth_attention_mix_qk_normed)
        depth_attention.depth_attention_mix_normed = self._counted("keys_folded",
                                                                   depth_attention.depth_attention_mix_normed)
        # a source's gradient summed over its static-query AttnRes readers at once, by its sink (grad_sink.Sink.defer)
        attnres_mix._resolve = self._counted("summed_at_once", attnres_mix._resolve)
        # mHC's phi gradient made by the streams' sum beside theirs (phi through the streams' sink node)
        sum_deferred = streams.sum_deferred

        def phi_summed(*args):
            out = sum_deferred(*args)
            if isinstance(out, tuple):
                self.counts["phi_summed"] = self.counts.get("phi_summed", 0) + 1
            return out

        streams.sum_deferred = phi_summed

    def _counted(self, key, fn):
        def counted(*args, **kwargs):
            self.counts[key] = self.counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return counted

    def take(self) -> dict:
        counts, self.counts = self.counts, {}
        return counts


def _dynamo_counts():
    """(graphs Dynamo has captured in this process so far, graph breaks it has met so far)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@contextlib.contextmanager
def _counting_core_attention(calls: list):
    """calls[0] counts the SDPA core attention's forward calls meanwhile: a recomputation runs a layer's (full) or
    the core's own (selective) again in backward."""
    from mega_depth.megatron.attention import SDPAttention

    forward = SDPAttention.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    SDPAttention.forward = counted
    try:
        yield
    finally:
        SDPAttention.forward = forward


_BUILDS = itertools.count()  # this process's backends so far


def train_layout(out_dir: str, layout, only, fused_paths: _FusedPaths) -> None:
    """Every mechanism (or those in `only`, comma-separated) for a few steps in one layout."""
    from megatron.core import parallel_state, tensor_parallel
    from torch.distributed import distributed_c10d

    from mega_depth.config import parse_args
    from mega_depth.data.datasets import GlobalBatchSampler, build_datasets, tokenizer_for
    from mega_depth.megatron.pipeline import pipelines_of
    from mega_depth.training.backends.megatron import MegatronBackend

    world = int(os.environ["WORLD_SIZE"])
    for name, flags in mechanism_flags(int(last_value(LAYOUT_MODEL + layout, "--num-layers"))).items():
        if only and name not in only.split(","):
            continue
        cfg = parse_args(LAYOUT_MODEL + flags + layout).validate(world)
        _, breaks_before = _dynamo_counts()
        backend = MegatronBackend(cfg)
        backend.build()
        # what this rank's dropout would draw next (the default generator's and the tensor-parallel tracker's)
        streams = [torch.rand(4, generator=torch.Generator().set_state(torch.get_rng_state())).tolist()]
        tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
        streams += [torch.rand(4, generator=torch.Generator().set_state(state)).tolist()
                    for _, state in sorted(tracker.items()) if state.device.type == "cpu"]
        mbs, nmb, dp, dp_rank = backend.sampler_shape
        data = build_datasets(cfg, tokenizer_for(cfg), (64, None, None))[0]
        sampler = GlobalBatchSampler(data, mbs, nmb, dp, dp_rank)
        losses, hops = [], {}
        compiled = "--compile-layers" in layout  # (a Python counter inside compiled layers would break graphs)
        attention_calls = [0]
        for step in range(cfg.training.train_iters):
            counting = _counting_core_attention(attention_calls) if step == 0 and not compiled else \
                contextlib.nullcontext()
            with counting:
                losses.append(backend.forward_backward(sampler.microbatches(step)))
            if step == 0:
                grads = full_grads(backend.modules, cfg)  # step 1's grads, before the optimizer consumes them
                for pipe in pipelines_of(backend.model):  # {to_stage: [width per token, bytes per micro-batch]}
                    hops = {str(k): [pipe.hops.widths[k], pipe.hops.bytes[k][0]] for k in pipe.hops.widths}
            backend.update()
        run_dir = os.path.join(out_dir, name)
        os.makedirs(run_dir, exist_ok=True)
        rank = backend.rank
        torch.save(grads, os.path.join(run_dir, f"grads_rank{rank}.pt"))  # every rank: experts differ over EP
        with open(os.path.join(run_dir, f"streams_rank{rank}.json"), "w") as f:
            json.dump({"pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "streams": streams}, f)
        if dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            with open(os.path.join(run_dir, f"hops_rank{rank}.json"), "w") as f:
                json.dump(hops, f)
        if rank == 0:
            with open(os.path.join(run_dir, "losses.json"), "w") as f:
                json.dump(losses, f)
            graphs, breaks = _dynamo_counts()
            with open(os.path.join(run_dir, "compiled.json"), "w") as f:  # --compile-layers took effect
                json.dump({"layers": sum(getattr(m, "compiled_whole", False)
                                         for chunk in backend.modules for m in chunk.modules()),
                           "graphs_in_process": graphs, "graph_breaks": breaks - breaks_before}, f)
            with open(os.path.join(run_dir, "fused_paths.json"), "w") as f:
                json.dump(fused_paths.take(), f)
            with open(os.path.join(run_dir, "attention_calls.json"), "w") as f:
                json.dump(None if compiled else attention_calls[0], f)
        backend.close()
        # The closed backend's model and optimizer hold its destroyed process groups in reference cycles: collected
        # now, their gloo threads and sockets go now (else they pile up, hundreds of busy threads, until Python's
        # collector gets to them).
        del backend
        gc.collect()
        if rank == 0:  # the process groups left once the backend is closed (the default one alone), and the
            # process's threads (OS threads: gloo's included), which a backend kept alive after close would add to
            with open(os.path.join(run_dir, "groups_after_close.json"), "w") as f:
                json.dump({"groups": len(distributed_c10d._world.pg_map),
                           "threads": len(os.listdir("/proc/self/task")), "build": next(_BUILDS)}, f)


def main() -> None:
    from mega_depth.megatron.deferred_fusions import import_megatron

    import_megatron()
    if sys.argv[1] == "--plan":
        with open(sys.argv[2]) as f:
            plan = json.load(f)
    else:
        plan = [{"out": sys.argv[1], "flags": sys.argv[2:], "mechanisms": os.environ.get("MECHANISMS")}]
    fused_paths = _FusedPaths()
    # Every source that a static-query AttnRes mix reads has its gradient summed by its sink (grad_sink.Sink.defer),
    # however few its readers, so that every layout exercises that path too (off by default: model/base.py; a
    # stage, virtual stage or recomputed layer holds 1 to 3 readers here)
    from mega_depth.model import base as model_base

    model_base.DEFER_READERS = 1
    if os.environ.get("FUSED_NORM_INTERPRETED") == "1":
        # Liger's norm as a GPU runs it, on CPU tensors under Triton's interpreter (the mixing ops keep their torch
        # twins: interpreting them too costs minutes a mechanism)
        from liger_bridge import bridge_liger_for_the_interpreter
        from mega_depth.megatron import layer, norm

        bridge_liger_for_the_interpreter()
        norm.fused_applies = layer.fused_applies = lambda x: not torch.compiler.is_compiling()
    for layout in plan:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"== layout {os.path.basename(layout['out'])}: {' '.join(layout['flags'])}", flush=True)
        train_layout(layout["out"], layout["flags"], layout["mechanisms"], fused_paths)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
