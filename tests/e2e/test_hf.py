"""Hugging Face export/import: logit parity with the training model for every mechanism, from checkpoints saved
at TP=1 x PP=1 and TP=2 x PP=2; KV-cache parity in generation; bit-exact round trip; offline loading; errors."""

import json
import os
import shutil

import pytest
import torch

from fixtures import CORPUS, READINGS, SAVE_MODEL, SCRIPTS, mechanism_flags, run, torchrun
from mega_depth.catalogue import SETTINGS

SCRIPT = os.path.join(SCRIPTS, "train_and_save.py")


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """Every mechanism trained 4 steps (so zero-initialised mixing parameters are nonzero), in two layouts."""
    root = tmp_path_factory.mktemp("trained")
    args = [str(data["dir"] / "docs"), str(data["dir"] / "spm.model")]
    torchrun(1, [SCRIPT, str(root / "tp1")] + args, str(root / "tp1.log"))
    torchrun(4, [SCRIPT, str(root / "tp2pp2")] + args + ["--tensor-model-parallel-size", "2",
                                                         "--pipeline-model-parallel-size", "2"],
             str(root / "tp2pp2.log"))
    return root


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    from mega_depth.hf.io import export_checkpoint

    out = tmp_path_factory.mktemp("hf")
    for layout in ("tp1", "tp2pp2"):
        for mech in SETTINGS + READINGS:
            export_checkpoint(str(trained / layout / mech / "ckpt"), str(out / layout / mech))
    return out


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state

    from mega_depth.megatron import cpu_compat, te_absent
    from mega_depth.training.distributed import init_process_group

    from megatron.core import tensor_parallel

    cpu_compat.apply()  # explicit: the reference below is the Megatron-core model, on CPU
    te_absent.apply()
    init_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def training_model(ckpt):
    """The Megatron-core model (TP=1) with the checkpoint's weights, loaded by Megatron's own dist-checkpointing
    (not by the export's reader): the reference for parity."""
    from megatron.core import dist_checkpointing

    from mega_depth.checkpoint.rules import find_checkpoint
    from mega_depth.checkpoint.weights import saved_config
    from mega_depth.megatron.builder import build_model_chunks

    path, meta = find_checkpoint(str(ckpt))
    (model,) = build_model_chunks(saved_config(meta))
    loaded = dist_checkpointing.load({"model0": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model0"])
    return model.eval()


def megatron_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def prompt(data):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(data["dir"] / "spm.model"))
    return torch.tensor([sp.encode("The tutorial explains how Python handles exceptions and")])


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
@pytest.mark.parametrize("mechanism", SETTINGS + READINGS)
def test_exported_logits_equal_the_training_model(megatron_world, trained, exports, prompt, layout, mechanism):
    ckpt = trained / layout / mechanism / "ckpt"
    ref = training_model(str(ckpt))
    if mechanism != "standard":  # trained: the zero-initialised parameters have moved
        # (layer 0's attention mixer has a single source, the embedding, so its query never moves)
        moved = [p for n, p in ref.named_parameters() if n.endswith(("mixer.query", "grn_qkv.proj"))
                 and "layers.0.attn_mixer" not in n]
        assert all(p.abs().max() > 0 for p in moved)
    model = hf_model(exports / layout / mechanism)
    config = json.load(open(exports / layout / mechanism / "config.json"))
    if mechanism == "standard":
        assert config["model_type"] == "qwen3" and "auto_map" not in config  # native, no remote code
    else:
        assert config["model_type"] == "mega_depth_lm" and "AutoModelForCausalLM" in config["auto_map"]
    with torch.no_grad():
        hf_logits = model(prompt).logits
    diff = (hf_logits - megatron_logits(ref, prompt)).abs().max().item()
    assert diff <= 1e-4, f"{layout}/{mechanism}: max |logit diff| {diff}"


@pytest.mark.parametrize("mechanism", SETTINGS + READINGS)
def test_kv_cache_generation_matches_no_cache_and_the_training_model(megatron_world, trained, exports, prompt,
                                                                    mechanism):
    model = hf_model(exports / "tp1" / mechanism)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    ref = training_model(str(trained / "tp1" / mechanism / "ckpt"))
    ids = prompt
    for _ in range(12):  # the training model's own greedy decoding (no cache)
        nxt = megatron_logits(ref, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    assert cached.tolist() == ids.tolist()


def test_depth_attention_cache_holds_mixed_values_in_the_standard_layout(exports, prompt):
    from transformers.cache_utils import DynamicCache

    model = hf_model(exports / "tp1" / "depth-attention")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
    layer = cache.layers[1]
    b, s = prompt.shape
    assert tuple(layer.keys.shape) == (b, 2, s, 8)  # GQA keys: 2 key-value heads of 8
    assert tuple(layer.values.shape) == (b, 4, s, 8)  # per-query-head mixed values (the authors' default)


@pytest.mark.parametrize("mechanism", ["attnres-block", "dca-2", "depth-attention", "standard"])
def test_round_trip_export_import_export_is_bit_exact(exports, tmp_path, mechanism):
    from safetensors.torch import load_file

    from mega_depth.hf.io import export_checkpoint, import_folder

    first = exports / "tp2pp2" / mechanism
    import_folder(str(first), str(tmp_path / "ckpt"))
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    a, b = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_native_qwen3_folder_imports(exports, tmp_path):
    """A plain Qwen3 folder (no mega_depth.json) imports from its config.json alone, bit for bit."""
    from safetensors.torch import load_file

    from mega_depth.hf.io import export_checkpoint, import_folder

    native = tmp_path / "qwen3"
    shutil.copytree(exports / "tp1" / "standard", native)
    os.remove(native / "mega_depth.json")
    import_folder(str(native), str(tmp_path / "ckpt"))
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    a, b = load_file(str(native / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# Mixture-of-experts exports: the standard residual with Qwen3-MoE's layer becomes a native qwen3_moe folder; a
# depth-mixing MoE model, or DeepSeek's routing (sigmoid, expert bias, a shared expert), mega_depth_lm.
MOE = ["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-aux-loss-coeff", "0.01"]
DEEPSEEK = MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01", "--moe-shared-expert-intermediate-size", "32"]
MOE_CASES = {("moe", "standard"): "qwen3_moe", ("moe", "attnres-block"): "mega_depth_lm",
             ("moe-deepseek", "mhc"): "mega_depth_lm"}


@pytest.fixture(scope="module")
def moe_exports(data, tmp_path_factory):
    """MoE models trained 4 steps (the routers and the expert bias move), saved at EP2 and exported."""
    from mega_depth.hf.io import export_checkpoint

    root = tmp_path_factory.mktemp("moe")
    args = [str(data["dir"] / "docs"), str(data["dir"] / "spm.model"), "--expert-model-parallel-size", "2"]
    for variant, flags in (("moe", MOE), ("moe-deepseek", DEEPSEEK)):
        mechanisms = ",".join(m for v, m in MOE_CASES if v == variant)
        torchrun(2, [SCRIPT, str(root / variant)] + args + flags, str(root / f"{variant}.log"),
                 env={"MECHANISMS": mechanisms})
        for v, mech in MOE_CASES:
            if v == variant:
                export_checkpoint(str(root / variant / mech / "ckpt"), str(root / "hf" / variant / mech))
    return root


@pytest.mark.parametrize("variant, mechanism", list(MOE_CASES))
def test_moe_exports_equal_the_training_model_and_cache(megatron_world, moe_exports, prompt, variant, mechanism):
    """Logits of the export equal the Megatron model's (its checkpoint saved at EP2, read here by one process);
    cached generation equals uncached and the training model's own greedy decoding."""
    folder = moe_exports / "hf" / variant / mechanism
    config = json.load(open(folder / "config.json"))
    assert config["model_type"] == MOE_CASES[(variant, mechanism)]
    if config["model_type"] == "qwen3_moe":
        assert "auto_map" not in config and config["mlp_only_layers"] == [0]
        assert config.get("num_experts", config.get("num_local_experts")) == 4
    else:
        assert config["moe"]["num_experts"] == 4 and config["moe"]["moe_layer_pattern"] == [0, 1, 1, 1]
    ref = training_model(str(moe_exports / variant / mechanism / "ckpt"))
    if variant == "moe-deepseek":  # the bias moved off zero: it steers the choice in both models
        assert any(b.abs().max() > 0 for n, b in ref.named_buffers() if n.endswith("expert_bias"))
    model = hf_model(folder)
    with torch.no_grad():
        diff = (model(prompt).logits - megatron_logits(ref, prompt)).abs().max().item()
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert diff <= 1e-4, f"{variant}/{mechanism}: max |logit diff| {diff}"
    assert cached.tolist() == uncached.tolist()
    ids = prompt
    for _ in range(12):
        ids = torch.cat([ids, megatron_logits(ref, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert cached.tolist() == ids.tolist()


@pytest.mark.parametrize("variant, mechanism", list(MOE_CASES))
def test_moe_round_trip_export_import_export_is_bit_exact(moe_exports, tmp_path, variant, mechanism):
    """Export -> import -> export keeps every weight bit for bit; the native Qwen3-MoE folder imports from its
    config.json alone (no mega_depth.json)."""
    from safetensors.torch import load_file

    from mega_depth.hf.io import export_checkpoint, import_folder

    first = tmp_path / "first"
    shutil.copytree(moe_exports / "hf" / variant / mechanism, first)
    if MOE_CASES[(variant, mechanism)] == "qwen3_moe":
        os.remove(first / "mega_depth.json")
    import_folder(str(first), str(tmp_path / "ckpt"))
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    a, b = load_file(str(first / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_imported_checkpoint_fine_tunes(data, exports, tmp_path):
    flags = SAVE_MODEL + mechanism_flags(4)["dca-2"] + data["flags"][:4]
    run(["tools/convert_from_hf.py", "--hf", str(exports / "tp1" / "dca-2"), "--save", str(tmp_path / "ckpt")])
    out = run(["-m", "mega_depth.train"] + flags + ["--load", str(tmp_path / "ckpt"), "--train-iters", "2",
                                                    "--output-dir", str(tmp_path / "run")]).stdout
    assert "weights-only checkpoint" in out and "at step 0" in out
    run(["-m", "mega_depth.train"] + flags + ["--train-iters", "2", "--output-dir", str(tmp_path / "fresh")])
    tuned = [json.loads(line)["loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    fresh = [json.loads(line)["loss"] for line in open(tmp_path / "fresh" / "metrics.jsonl")]
    assert len(tuned) == 2 and tuned[0] < fresh[0] - 0.05  # it starts from the trained weights


def test_offline_tokenizer_and_pipeline(data, exports):
    import sentencepiece as spm
    from transformers import AutoTokenizer, pipeline

    sp = spm.SentencePieceProcessor(model_file=str(data["dir"] / "spm.model"))
    # (sentencepiece and transformers' LlamaTokenizer can split runs of LEADING spaces differently; inner
    # whitespace, tabs, newlines and digits match, which is what mega_depth's documents contain)
    text = "Python's  for statement iterates over 3 items:\n\tlists, tuples and strings.\n\nAll 42 of them."
    for mechanism in ("standard", "attnres-block"):
        folder = str(exports / "tp1" / mechanism)
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        assert tok(text)["input_ids"] == sp.encode(text)
        generator = pipeline("text-generation", model=folder, tokenizer=folder, trust_remote_code=True)
        out = generator("The tutorial", max_new_tokens=8, do_sample=False)[0]["generated_text"]
        assert out.startswith("The tutorial") and len(out) > len("The tutorial")


# Three prompts of different lengths (a padded batch), and a fourth for the pipeline's batch of 4.
PROMPTS = ["The tutorial explains how Python handles exceptions and", "A list", "Strings are immutable, so"]


def test_every_export_names_a_pad_token(exports):
    """config.json (native Qwen3 and mega_depth_lm), generation_config.json and tokenizer_config.json: the pad is
    EOS `</s>` (id 2; mega_depth's sentencepiece models have no pad piece), padding on the left."""
    for mechanism in SETTINGS:
        folder = exports / "tp1" / mechanism
        assert json.load(open(folder / "config.json"))["pad_token_id"] == 2, mechanism
        assert json.load(open(folder / "generation_config.json"))["pad_token_id"] == 2, mechanism
        tokenizer = json.load(open(folder / "tokenizer_config.json"))
        assert (tokenizer["tokenizer_class"], tokenizer["pad_token"], tokenizer["padding_side"]) == \
            ("LlamaTokenizer", "</s>", "left"), mechanism


@pytest.mark.parametrize("mechanism", SETTINGS)
def test_padded_batches_generate_and_score_as_each_prompt_alone(exports, mechanism):
    """Left padding (generate, with and without the KV cache) and right padding (forward): every row's tokens and
    real-position logits are its prompt's alone; an all-ones mask is the unpadded computation bit for bit."""
    from transformers import AutoTokenizer

    folder = exports / "tp1" / mechanism
    model = hf_model(folder)
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    alone = [tok(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    lengths = [ids.shape[1] for ids in alone]
    assert len(set(lengths)) == len(PROMPTS)
    left = tok(PROMPTS, padding=True, return_tensors="pt")  # the export's own pad token and side
    tok.padding_side = "right"
    right = tok(PROMPTS, padding=True, return_tensors="pt")
    width, pad = left["input_ids"].shape[1], model.config.pad_token_id
    assert tok.pad_token_id == pad == 2 and (left["attention_mask"][:, 0] == 0).any()
    with torch.no_grad():
        if mechanism != "standard":  # (the native export is transformers' own Qwen3)
            ones = torch.ones_like(alone[0])
            assert torch.equal(model(alone[0], attention_mask=ones).logits, model(alone[0]).logits)
        reference = [model(ids).logits[0] for ids in alone]
        for padded, side in ((left, "left"), (right, "right")):
            logits = model(**padded).logits
            assert torch.isfinite(logits).all(), side  # the pads' rows too
            for i, n in enumerate(lengths):
                real = slice(width - n, width) if side == "left" else slice(0, n)
                torch.testing.assert_close(logits[i, real], reference[i], rtol=0, atol=1e-5)
        for use_cache in (True, False):
            batch = model.generate(**left, max_new_tokens=6, do_sample=False, use_cache=use_cache)
            for i, ids in enumerate(alone):
                one = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=use_cache)[0, ids.shape[1]:]
                new = batch[i, width:].tolist()  # (a row that met EOS goes on with pads: EOS is the pad)
                assert new[:len(one)] == one.tolist() and set(new[len(one):]) <= {pad}, (use_cache, i, new, one)


@pytest.mark.parametrize("mechanism", ["standard", "attnres-block", "depth-attention"])
def test_text_generation_pipeline_batches_padded_prompts(exports, mechanism):
    from transformers import pipeline

    folder = str(exports / "tp1" / mechanism)
    generator = pipeline("text-generation", model=folder, tokenizer=folder, trust_remote_code=True)
    prompts = PROMPTS + ["Python"]
    batched = [out[0]["generated_text"] for out in generator(prompts, batch_size=4, max_new_tokens=6,
                                                              do_sample=False)]
    assert all(text.startswith(p) for text, p in zip(batched, prompts)), batched
    assert batched == [generator(p, max_new_tokens=6, do_sample=False)[0]["generated_text"] for p in prompts]


def test_depth_mixing_tokenizer_loads_without_trust_remote_code(data, exports):
    """AutoTokenizer on a depth-mixing export without trust_remote_code (stdin closed: a prompt that waited for an
    answer would fail here instead of hanging): tokenizer_config.json names LlamaTokenizer, so no remote code is
    needed. transformers 5 reads config.json through AutoConfig first, whose remote-code question an absent
    trust_remote_code still meets (and, with no answer, passes over); trust_remote_code=False skips it."""
    import subprocess

    from fixtures import ENV, PY, ROOT

    folder = str(exports / "tp1" / "attnres-block")
    for flag in ("", ", trust_remote_code=False"):
        code = f"""
import json
import sentencepiece as spm
from transformers import AutoTokenizer
sp = spm.SentencePieceProcessor(model_file={str(data["dir"] / "spm.model")!r})
tok = AutoTokenizer.from_pretrained({folder!r}{flag})
text = {PROMPTS[0]!r}
batch = tok([text, "A list"], padding=True)
print("RESULT", json.dumps([type(tok).__name__, tok.pad_token, tok.pad_token_id, tok.padding_side,
                            tok(text)["input_ids"] == sp.encode(text), batch["attention_mask"][1][0]]))
"""
        proc = subprocess.run([PY, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=ROOT,
                              env=ENV, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.split("RESULT ")[-1]) == ["LlamaTokenizer", "</s>", 2, "left", True, 0]
        if flag:
            assert "[y/N]" not in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize("mechanism", ["attnres-block", "depth-attention"])
def test_save_pretrained_round_trip_keeps_the_logits(exports, prompt, tmp_path, mechanism):
    model = hf_model(exports / "tp1" / mechanism)
    model.save_pretrained(str(tmp_path / "saved"))
    again = hf_model(tmp_path / "saved")  # from the code files save_pretrained copied along
    assert again.config.residual == model.config.residual and again.config.pad_token_id == 2
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, model(prompt).logits)


def test_generate_tool_samples_without_deprecation_noise(exports):
    """README command 1's last step: the sample starts with the prompt, and transformers has nothing to warn about
    (the model's output names its cache as transformers 5 does)."""
    proc = run(["tools/generate.py", str(exports / "tp1" / "attnres-block"), "--prompt", "The tutorial",
                "--max-new-tokens", "8"])
    assert proc.stdout.split("--- sample")[1].split("\n")[1].startswith("The tutorial")
    assert "deprecated" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize("case", ["not-a-checkpoint", "missing-tokenizer", "non-empty-out", "bad-dtype",
                                  "config-mismatch", "config-mismatch-unverified", "too-large-tokenizer",
                                  "replaced-tokenizer"])
def test_export_bad_input_gets_a_clear_error_and_writes_nothing(trained, tmp_path, case):
    ckpt = trained / "tp1" / "attnres-block" / "ckpt"
    out = tmp_path / "out"
    args = ["tools/convert_to_hf.py", "--load", str(ckpt), "--out", str(out)]
    expected = {"not-a-checkpoint": "does not exist", "missing-tokenizer": "no tokenizer for this checkpoint",
                "non-empty-out": "exists and is not empty; pass --force", "bad-dtype": "--dtype 'fp16' is not supported",
                "config-mismatch": "is damaged: mega_depth.json",
                "config-mismatch-unverified": "its weights do not match its recorded config",
                "too-large-tokenizer": "has 2000 pieces, more than the model's vocabulary (1024)",
                "replaced-tokenizer": "is not the one this checkpoint was trained with"}[case]
    if case == "not-a-checkpoint":
        args[2] = str(tmp_path / "nowhere")
    elif case == "missing-tokenizer":
        args += ["--tokenizer-model", str(tmp_path / "missing.model")]
    elif case == "non-empty-out":
        out.mkdir()
        (out / "keep.txt").write_text("user data")
    elif case == "bad-dtype":
        args += ["--dtype", "fp16"]
    elif case == "too-large-tokenizer":  # generation would index past the embedding
        run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "2000", "--output-prefix",
             str(tmp_path / "large")])
        args += ["--tokenizer-model", str(tmp_path / "large.model")]
    else:
        broken = tmp_path / "broken"
        shutil.copytree(ckpt / "iter_0000004", broken)
        meta = json.load(open(broken / "mega_depth.json"))
        if case == "replaced-tokenizer":  # the recorded path now holds another file than the run trained with
            assert meta["tokenizer_sha256"]  # recorded at the save
            shutil.copy(meta["config"]["data"]["tokenizer_model"], tmp_path / "spm.model")
            with open(tmp_path / "spm.model", "ab") as f:
                f.write(b"\0")
            meta["config"]["data"]["tokenizer_model"] = str(tmp_path / "spm.model")
        else:
            meta["config"]["model"]["hidden_size"] = 64
        if case != "config-mismatch":  # as written before manifests existed (an edited record is no damage then)
            os.remove(broken / "manifest.json")
            for key in ("config_hash", "manifest"):
                meta.pop(key, None)
        json.dump(meta, open(broken / "mega_depth.json", "w"))
        args[2] = str(broken)
    proc = run(args, expect=2)
    assert expected in proc.stderr, proc.stderr[-2000:]
    if case == "non-empty-out":
        assert os.listdir(out) == ["keep.txt"]  # untouched
    else:
        assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".export-")]  # no half-written folder


def _tree(folder):
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


@pytest.mark.parametrize("where", ["equal", "inside", "parent"])
def test_export_never_writes_into_its_own_source(trained, tmp_path, where):
    """--out equal to, inside or a parent of --load is refused, --force or not, and the checkpoints stay."""
    ckpt = tmp_path / "job" / "ckpt"
    shutil.copytree(trained / "tp1" / "attnres-block" / "ckpt", ckpt)
    before = _tree(tmp_path / "job")
    out = {"equal": ckpt, "inside": ckpt / "hf", "parent": tmp_path / "job"}[where]
    proc = run(["tools/convert_to_hf.py", "--load", str(ckpt), "--out", str(out), "--force"], expect=2)
    said = {"equal": "is", "inside": "lies inside", "parent": "contains"}[where]
    assert f"--out {out} {said} --load {ckpt}: writing it would delete what it is made from" in proc.stderr
    assert "Traceback" not in proc.stderr and _tree(tmp_path / "job") == before


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("case", ["truncated-weights-no-manifest", "truncated-weights-old-checkpoint",
                                  "truncated-safetensors", "garbage-mega-depth-json", "edited-config-json",
                                  "into-a-training-folder", "into-its-source", "into-a-held-folder"])
def test_import_and_export_of_damaged_files_and_wrong_folders_get_one_line(trained, exports, tmp_path, case):
    from mega_depth.checkpoint.lock import LOCK

    ckpt = trained / "tp1" / "attnres-block" / "ckpt"
    folder = tmp_path / "folder"
    if case.startswith("truncated-weights"):  # an export of a checkpoint whose weights were cut short
        shutil.copytree(ckpt / "iter_0000004", folder)
        _truncate(folder / sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0])
        os.remove(folder / "manifest.json")
        expected = "is damaged: manifest.json is missing"
        if case.endswith("old-checkpoint"):  # written before manifests: read as it is, and the read fails
            meta = json.load(open(folder / "mega_depth.json"))
            for key in ("config_hash", "manifest"):
                meta.pop(key, None)
            json.dump(meta, open(folder / "mega_depth.json", "w"))
            expected = "the checkpoint is damaged"
        args = ["tools/convert_to_hf.py", "--load", str(folder), "--out", str(tmp_path / "out")]
    else:
        shutil.copytree(exports / "tp1" / "attnres-block", folder)
        save = tmp_path / "out"
        if case == "truncated-safetensors":
            _truncate(folder / "model.safetensors")
            expected = "model.safetensors cannot be read as safetensors"
        elif case == "garbage-mega-depth-json":
            (folder / "mega_depth.json").write_text("{not json")
            expected = "mega_depth.json is not valid JSON"
        elif case == "edited-config-json":
            config = json.load(open(folder / "config.json"))
            config["num_hidden_layers"] += 1
            json.dump(config, open(folder / "config.json", "w"))
            expected = "config.json and mega_depth.json disagree (num_hidden_layers 5 vs num_layers 4)"
        elif case == "into-a-training-folder":  # another run's --save folder
            save = tmp_path / "training"
            shutil.copytree(ckpt, save)
            expected = "holds training checkpoints (iter_0000004, ...): an import must not write beside them"
        elif case == "into-its-source":
            save = folder
            expected = f"--save {folder} is --hf {folder}: writing it would delete what it is made from"
        else:
            save = tmp_path / "held"
            save.mkdir()
            (save / LOCK).write_text(json.dumps({"run_id": "live", "host": __import__("socket").gethostname(),
                                                 "pid": os.getpid(), "started": 0, "token": "t"}))
            expected = "is in use by run live"
        args = ["tools/convert_from_hf.py", "--hf", str(folder), "--save", str(save), "--force"]
        before = _tree(save) if save.exists() else None
    proc = run(args, expect=2)
    assert expected in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-2000:]
    if not case.startswith("truncated-weights"):
        assert (_tree(save) if save.exists() else None) == before
    assert not (tmp_path / "out").exists()


def test_xla_trainer_checkpoint_exports_and_fine_tunes_on_megatron(data, prompt, tmp_path):
    """The plain/XLA trainer's checkpoint (trained eagerly here; tests/xla trains it under torch-xla) exports to a
    Hugging Face folder with the trained model's logits, and the Megatron trainer fine-tunes from its weights after
    convert_from_hf (its full checkpoint is refused with that command)."""
    from safetensors.torch import load_file

    from mega_depth.checkpoint.rules import find_checkpoint
    from mega_depth.checkpoint.weights import canonical_weights
    from mega_depth.model.decoder import CausalLM

    flags = SAVE_MODEL + mechanism_flags(4)["attnres-block"] + data["flags"][:4]
    run(["-m", "mega_depth.xla.train", "--device", "cpu"] + flags + [
        "--save", str(tmp_path / "plain"), "--output-dir", str(tmp_path / "run")])
    run(["tools/convert_to_hf.py", "--load", str(tmp_path / "plain"), "--out", str(tmp_path / "hf")])
    weights, dc = canonical_weights(*find_checkpoint(str(tmp_path / "plain")))
    trained = CausalLM(dc)
    trained.load_state_dict(weights, strict=False)
    assert trained.model.layers[1].attn_mixer.query.abs().max() > 0  # trained, not the initialisation
    with torch.no_grad():
        diff = (hf_model(tmp_path / "hf")(prompt).logits - trained.eval()(prompt)).abs().max().item()
    assert diff <= 1e-5

    run(["tools/convert_from_hf.py", "--hf", str(tmp_path / "plain"), "--save", str(tmp_path / "weights")])
    run(["tools/convert_to_hf.py", "--load", str(tmp_path / "weights"), "--out", str(tmp_path / "hf2")])
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    out = run(["-m", "mega_depth.train"] + flags + ["--load", str(tmp_path / "weights"), "--train-iters", "1",
                                                    "--output-dir", str(tmp_path / "fine-tune")]).stdout
    assert "weights-only checkpoint" in out and "at step 0" in out
    refused = run(["-m", "mega_depth.train"] + flags + ["--load", str(tmp_path / "plain"), "--output-dir",
                                                        str(tmp_path / "refused")], expect=2)
    assert "convert_from_hf.py" in refused.stderr and "Traceback" not in refused.stderr


def test_export_does_not_patch_torch_for_the_rest_of_the_session(exports, tmp_path, trained):
    """The export reads checkpoints with pure torch: no CPU-compatibility patch is applied by it."""
    code = f"""
import sys
import torch
original = torch.cuda.current_device
from mega_depth.hf.io import export_checkpoint
export_checkpoint({str(trained / "tp1" / "attnres-block" / "ckpt")!r}, {str(tmp_path / "out")!r})
assert torch.cuda.current_device is original, "torch.cuda was patched"
assert "megatron.core" not in sys.modules, "the export imported megatron-core"
print("ok")
"""
    assert run(["-c", code]).stdout.strip().endswith("ok")
