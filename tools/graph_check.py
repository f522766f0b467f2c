"""A captured step trains as the eager one: --cuda-graph-impl local against eager, every mechanism, same batches.

    python tools/graph_check.py [--mechanisms a,b] [--hidden-size 256 --num-layers 4 --seq-length 256] [--out f.json]

For each setting two Megatron backends are built alike (same seed and data), one eager and one whose step is
captured as a CUDA graph after one eager warm-up step (mega_depth/megatron/step_graph.py); both train --steps
optimizer steps on the same micro-batches (two a step). The losses and the gradient norms are compared step by step,
and what the steps did to the weights at the end: a replay whose gradients miss a parameter, or keep a stale one,
still computes its step's loss right, and the norm shows it; the updates show a parameter that the optimizer step
left out. On a GPU two eager runs differ by the nondeterminism of a few cuBLAS and embedding-gradient kernels, so
the check allows a relative --tolerance on the losses and --grad-norm-tolerance on the norms and the updates (sums
over every gradient, which those kernels reach more of); the host's time to issue a step is reported for both. On a
CPU the capture is stood in for by step_graph.RerunCapture (a dry run of the plumbing: losses, norms and updates
must then be equal). Exits 1 if any of them differ for a setting, or its capture failed.
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_model_args, model_flags  # noqa: E402
from mega_depth.catalogue import parse_mechanisms  # noqa: E402

TARGETS = "standard,attnres-block,depth-attention,dca-2,dca,attnres-full,mhc"


def compare(name: str, flags, steps: int, gpu: bool) -> dict:
    import torch

    from harness import megatron_run
    from mega_depth.megatron.step_graph import RerunCapture, StepGraph

    backends = []
    try:
        eager, sampler = megatron_run(flags, 64)
        backends.append(eager)
        graphed, _ = megatron_run(flags + ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"] if gpu
                                  else flags, 64)
        backends.insert(0, graphed)  # closed first: its graph goes before anything it reads
        if not gpu:
            graphed.step_graph = StepGraph(1, torch.device("cpu"), new_capture=RerunCapture)
        start = {label: _weights(backend) for label, backend in (("eager", eager), ("graphed", graphed))}
        if not all(torch.equal(a, b) for a, b in zip(start["eager"], start["graphed"])):
            raise RuntimeError("the eager and the captured run start from different weights: the comparison of "
                               "their training means nothing (the seed or the build differs)")
        losses = {"eager": [], "graphed": []}
        grad_norms = {"eager": [], "graphed": []}
        host_ms = {"eager": [], "graphed": []}
        for step in range(steps):
            batches = sampler.microbatches(step)
            for label, backend in (("eager", eager), ("graphed", graphed)):
                if gpu:
                    torch.cuda.synchronize()
                began = time.perf_counter()
                loss = backend.forward_backward(batches)  # (reads the loss: the host waits for the step's end)
                host_ms[label].append(1e3 * (time.perf_counter() - began))
                norm, _ = backend.update()
                losses[label].append(loss)
                grad_norms[label].append(float(norm))  # (a device scalar: the host waits, outside the timing)
        captured = graphed.step_graph is not None and graphed.step_graph.captured
        # what the steps did to the weights, captured against eager: over all tensors on a GPU (one tensor whose
        # gradient is about zero gets an Adam update of the noise's sign), and tensor by tensor on a CPU
        moved = {label: [w - w0 for w, w0 in zip(_weights(backend), start[label])]
                 for label, backend in (("eager", eager), ("graphed", graphed))}
        update_gap = (torch.stack([(g - e).norm() for g, e in zip(moved["graphed"], moved["eager"])]).norm()
                      / torch.stack([e.norm() for e in moved["eager"]]).norm().clamp_min(1e-30)).item()
        updates_equal = all(torch.equal(g, e) for g, e in zip(moved["graphed"], moved["eager"]))
    finally:  # a failed capture too: the next setting starts from a clean process state
        for backend in backends:
            backend.close()
    return {"losses": losses, "max_relative_difference": _worst(losses), "grad_norms": grad_norms,
            "max_relative_grad_norm_difference": _worst(grad_norms), "relative_update_difference": update_gap,
            "updates_equal": updates_equal, "step_ms": host_ms, "captured": captured}


def _weights(backend) -> list:
    """Copies of the weights the optimizer updates: under --bf16 its fp32 master weights, whose updates are
    Adam's own (the model's bf16 copies move only where a master weight crosses a rounding step, and two runs
    a rounding apart would differ there by a whole step)."""
    inner = getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
    return [p.detach().float().clone() for optimizer in inner for p in optimizer.get_parameters()]


def _worst(series: dict) -> float:
    """The largest relative difference, step by step, of the captured run's values from the eager run's (a NaN in
    either is the largest: NaN compares unequal to itself, and `max` would pass it over)."""
    gaps = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(series["eager"], series["graphed"])]
    return max((float("inf") if gap != gap else gap for gap in gaps), default=0.0)


def agrees(result: dict, tolerance: float, grad_norm_tolerance: float, gpu: bool) -> bool:
    """Captured, and its losses, gradient norms and weight updates those of the eager run: within the tolerances
    on a GPU (the updates within the gradient norms' one), equal on a CPU (where the capture is a rerun of the same
    closure)."""
    if not result["captured"]:
        return False
    if gpu:
        return (result["max_relative_difference"] <= tolerance
                and result["max_relative_grad_norm_difference"] <= grad_norm_tolerance
                and result["relative_update_difference"] <= grad_norm_tolerance)
    return result["updates_equal"] and all(result[key]["eager"] == result[key]["graphed"]
                                           for key in ("losses", "grad_norms"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mechanisms", default=TARGETS)
    add_model_args(parser, hidden_size=256, seq_length=256)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (the first is the eager warm-up)")
    parser.add_argument("--tolerance", type=float, default=2e-3,
                        help="largest relative difference of a step's loss on a GPU (on a CPU the losses must "
                             "be equal)")
    parser.add_argument("--grad-norm-tolerance", type=float, default=1e-2,
                        help="largest relative difference of a step's gradient norm, and of the weights' updates "
                             "over the run, on a GPU (on a CPU they must be equal)")
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args(argv)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the warm-up, the capture, a replay)")

    import torch

    from harness import start

    start()
    gpu = torch.cuda.is_available()
    results, failed = {}, []
    for name in parse_mechanisms(args.mechanisms):
        flags = model_flags(args, name, args.steps, gpu, extra)
        try:
            result = compare(name, flags, args.steps, gpu)
            ok = agrees(result, args.tolerance, args.grad_norm_tolerance, gpu)
        except Exception as exc:  # a capture that failed: reported with where, and the next setting runs
            where = "".join(traceback.format_tb(exc.__traceback__)[-6:])
            result, ok = {"error": f"{type(exc).__name__}: {exc}\n{where}"}, False
        result["ok"] = ok
        results[name] = result
        if not ok:
            failed.append(name)
        if "error" in result:
            print(f"{name}: FAILED {result['error'].splitlines()[0]}", flush=True)
        else:
            ms = {k: sorted(v[2:])[len(v[2:]) // 2] for k, v in result["step_ms"].items()}
            print(f"{name}: {'ok' if ok else 'DIFFERENT'}, losses differ by {result['max_relative_difference']:.2e} "
                  f"at most, gradient norms by {result['max_relative_grad_norm_difference']:.2e}, the weights' "
                  f"updates by {result['relative_update_difference']:.2e}; step {ms['eager']:.1f} ms eager, "
                  f"{ms['graphed']:.1f} ms captured", flush=True)
        if args.out:  # after every setting: a run cut short by its time box keeps what it finished
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "results": results}, f,
                          indent=1)
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
