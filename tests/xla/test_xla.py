"""The TPU path for real, on the CPU PJRT device: XLA losses equal the eager run's, 2-device SPMD (data parallel
and FSDP) equals 1 device, a run with dropout resumes exactly, and an XLA checkpoint exports to Hugging Face with
the XLA model's logits."""

import json
import os

import pytest
import torch

from fixtures import READINGS, metrics
from xla_helpers import MAIN_PY, ROOT, RUN_PLAIN, run, run_together
from mega_depth.catalogue import SETTINGS

# 2-device layouts, data parallel and FSDP-sharded, on four settings with different parameter shapes (AttnRes's
# per-sublayer queries, Depth-Attention's none, DCA's depth-growing GRNs, mHC's [n*n+2n, n*d] projections): the
# mixing is the same plain-PyTorch code under every mesh, and XLA's CPU compiler costs ~15 s per setting and mesh
# (at -O0, xla_helpers.XLA_FLAGS).
SPMD = {"attnres-block": "2,1", "depth-attention": "2,1", "dca-2": "1,2", "mhc": "1,2"}
PRECISE = ["--mat-mul-precision", "highest"]
SMALL = ["--num-layers", "2"]  # run_layout.py's model, two layers deep: XLA's CPU compiler is slow


def losses(root, mechanism):
    return json.loads((root / mechanism / "losses.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla")
    # the one-device XLA run in two processes (half the settings each): the longest job otherwise
    every = SETTINGS + READINGS
    halves = [",".join(every[: len(every) // 2]), ",".join(every[len(every) // 2:])]
    jobs = [([RUN_PLAIN, str(root / "eager"), "--device", "cpu"] + SMALL, None)]
    jobs += [([RUN_PLAIN, str(root / "xla1")] + SMALL + PRECISE, {"MECHANISMS": half}) for half in halves]
    for mesh in sorted(set(SPMD.values())):
        only = ",".join(m for m, v in SPMD.items() if v == mesh)
        jobs.append(([RUN_PLAIN, str(root / f"xla2-{mesh.replace(',', 'x')}"), "--mesh", mesh] + SMALL + PRECISE,
                     {"CPU_NUM_DEVICES": "2", "MECHANISMS": only}))
    run_together(jobs)
    return root


@pytest.mark.parametrize("mechanism", SETTINGS + READINGS)
def test_xla_losses_equal_the_eager_run(runs, mechanism):
    xla, eager = losses(runs / "xla1", mechanism), losses(runs / "eager", mechanism)
    assert len(xla) == len(eager) == 3 and xla[-1] < xla[0]
    torch.testing.assert_close(torch.tensor(xla), torch.tensor(eager), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mechanism", list(SPMD))
def test_two_device_spmd_equals_one_device(runs, mechanism):
    mesh = SPMD[mechanism].replace(",", "x")
    spmd, single = losses(runs / f"xla2-{mesh}", mechanism), losses(runs / "xla1", mechanism)
    torch.testing.assert_close(torch.tensor(spmd), torch.tensor(single), rtol=1e-5, atol=1e-6)


# Mixture of experts on XLA (every expert on every token, weighted: static shapes) with the load-balancing loss
# per data-parallel shard: equal to the eager run, and 2-device data parallelism equal to 1 device.
MOE = ["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-aux-loss-coeff", "0.01"]


def test_xla_moe_equals_the_eager_run_on_one_and_two_devices(tmp_path):
    env = {"MECHANISMS": "attnres-block"}
    run_together([([RUN_PLAIN, str(tmp_path / "eager"), "--device", "cpu"] + SMALL + MOE, env),
                  ([RUN_PLAIN, str(tmp_path / "xla1")] + SMALL + MOE + PRECISE, env),
                  ([RUN_PLAIN, str(tmp_path / "xla2"), "--mesh", "2,1"] + SMALL + MOE + PRECISE,
                   dict(env, CPU_NUM_DEVICES="2"))])
    eager = losses(tmp_path / "eager", "attnres-block")
    assert eager[-1] < eager[0]
    for name in ("xla1", "xla2"):
        torch.testing.assert_close(torch.tensor(losses(tmp_path / name, "attnres-block")), torch.tensor(eager),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_an_xla_run_with_dropout_resumes_exactly(tmp_path):
    """The XLA device draws dropout from its own generator: the checkpoint carries its state, so the resumed steps
    draw the masks the uninterrupted run drew."""
    train = ["-m", "mega_depth.xla.train", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "4", "--lr", "1e-2", "--hidden-dropout", "0.2", "--attention-dropout", "0.2",
             "--log-interval", "1", "--no-tensorboard"] + PRECISE
    ckpt = str(tmp_path / "ckpt")
    run_together([(train + ["--output-dir", str(tmp_path / "straight")], None),
                  (train + ["--save", ckpt, "--exit-interval", "2", "--output-dir", str(tmp_path / "resumed")], None)])
    run(train + ["--load", ckpt, "--output-dir", str(tmp_path / "resumed")])
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert [resumed[s]["loss"] for s in (1, 2, 3, 4)] == [straight[s]["loss"] for s in (1, 2, 3, 4)]


def test_xla_checkpoint_exports_to_hugging_face_with_equal_logits(tmp_path):
    corpus = os.path.join(ROOT, "data", "corpus", "python-docs-3.11.jsonl.gz")
    run(["tools/train_tokenizer.py", "--input", corpus, "--vocab-size", "600", "--output-prefix",
         str(tmp_path / "spm")], python=MAIN_PY)
    ckpt = tmp_path / "ckpt"
    run(["-m", "mega_depth.xla.train", "--mock-data", "--tokenizer-model", str(tmp_path / "spm.model"),
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
         "--lr", "1e-2", "--residual", "dca", "--dca-last-k", "2", "--mesh", "1,2", "--save", str(ckpt),
         "--output-dir", str(tmp_path / "run"), "--no-tensorboard"] + PRECISE, env={"CPU_NUM_DEVICES": "2"})
    ids = [[5, 17, 33, 2, 250, 9, 41, 77]]
    # The trained weights on the XLA device (its own process), and the exported folder in the main environment.
    run(["-c", f"""
import torch, torch_xla, torch_xla.backends
torch_xla.backends.set_mat_mul_precision("highest")
from mega_depth.checkpoint.rules import find_checkpoint
from mega_depth.checkpoint.weights import canonical_weights
from mega_depth.model.decoder import CausalLM
weights, dc = canonical_weights(*find_checkpoint({str(ckpt)!r}))
model = CausalLM(dc)
model.load_state_dict(weights, strict=False)
model = model.to(torch_xla.device()).eval()
model.tie_weights()
with torch.no_grad():
    logits = model(torch.tensor({ids}).to(torch_xla.device())).cpu()
torch.save(logits, {str(tmp_path / "xla_logits.pt")!r})
"""])
    run(["tools/convert_to_hf.py", "--load", str(ckpt), "--out", str(tmp_path / "hf")], python=MAIN_PY)
    out = run(["-c", f"""
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.tensor({ids})).logits
ref = torch.load({str(tmp_path / "xla_logits.pt")!r})
print("max_diff", (logits - ref).abs().max().item(), "trained_dca", model.model.layers[1].grn_qkv.proj.abs().max().item())
"""], python=MAIN_PY).stdout
    diff, trained = (float(x) for x in out.split()[1::2])
    assert trained > 0 and diff <= 1e-4, out
