"""Every invalid combination fails at start-up with a message that names the fix."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from fixtures import ROOT
from mega_depth.config import ConfigError, parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data"]


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--residual", "hyper"], 1, "unknown --residual 'hyper'; choose one of standard, attnres, dca"),
        (["--hidden-size", "66"], 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
         "change --num-layers-per-virtual-pipeline-stage"),
        (["--residual", "attnres", "--attnres-num-blocks", "9"], 1, "--attnres-num-blocks 9 must lie in 1..8"),
        (["--residual", "dca", "--dca-last-k", "5"], 1, "--dca-last-k 5 must lie in 1..--num-layers (4)"),
        (["--residual", "dca", "--dca-grn", "v4"], 1, "unknown --dca-grn 'v4'"),
        (["--residual", "depth-attention", "--fused-single-qkv-rope"], 1,
         "never materialises; drop --fused-single-qkv-rope"),
        (["--residual", "depth-attention", "--depth-attn-gqa", "mean"], 1, "unknown --depth-attn-gqa 'mean'"),
        (["--residual", "attnres", "--attnres-heads", "3"], 1, "--attnres-heads 3 must divide --hidden-size 64"),
        (["--residual", "attnres", "--attnres-mixing", "scalar", "--attnres-heads", "2"], 1,
         "--attnres-mixing scalar has no query to split into heads"),
        (["--lr", "0"], 1, "--lr 0.0 must be positive"),
        (["--min-lr", "1"], 1, "--min-lr 1.0 must lie in [0, --lr 0.001]"),
        (["--adam-beta2", "1.5"], 1, "--adam-beta2 1.5 must lie in [0, 1)"),
        (["--keep-last", "0"], 1, "--keep-last must be >= 1"),
        (["--mixing-impl", "fast"], 1, "unknown --mixing-impl 'fast'"),
        (["--attention-backend", "flash"], 1, "unknown --attention-backend 'flash'"),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by TP x PP = 2 x 1"),
        (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (["--num-experts", "4", "--expert-model-parallel-size", "3"], 3,
         "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
        (["--num-experts", "4", "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
         "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 must divide the 2 ranks of a pipeline"),
        (["--num-experts", "4", "--moe-router-topk", "1"], 1, "needs --moe-router-pre-softmax"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "need --sequence-parallel"),
        (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5 must lie in 1..--num-experts (4)"),
        (["--num-experts", "4", "--moe-grouped-gemm"], 1, "--moe-grouped-gemm needs Transformer Engine or the "
                                                          "grouped_gemm package"),
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs experts: add --num-experts"),
        (["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*2)"], 1,
         "--moe-layer-freq '([0]*1+[1]*2)' lists 3 layers but --num-layers is 4"),
        (["--num-experts", "4", "--moe-layer-freq", "every"], 1, "expected N or a list of 0/1 per layer"),
        (["--num-experts", "4", "--residual", "attnres", "--pipeline-model-parallel-size", "2",
          "--moe-token-dispatcher-type", "allgather"], 2, "use --moe-token-dispatcher-type alltoall"),
        (["--num-experts", "4", "--expert-model-parallel-size", "2", "--deepspeed", "--deepspeed-config", "x.json"],
         2, "--deepspeed trains with ZeRO data parallelism and cannot split experts"),
        (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6,
         "world size 6 is not divisible by TP x CP x PP = 2 x 2 x 1"),
        (["--context-parallel-size", "4", "--seq-length", "20"], 4,
         "--seq-length 20 is not divisible by 2 x --context-parallel-size = 8"),
        (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
          "--seq-length", "12"], 8, "pick a --seq-length divisible by CP x TP = 8"),
        (["--context-parallel-size", "2", "--attention-backend", "unfused"], 2,
         "--context-parallel-size needs --attention-backend sdpa"),
        (["--context-parallel-size", "2", "--deepspeed", "--deepspeed-config", "x.json"], 2,
         "use the Megatron path (no --deepspeed) for tensor, context or pipeline parallelism"),
        (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
        (["--global-batch-size", "3", "--micro-batch-size", "2"], 1, "--global-batch-size 3 is not divisible"),
        (["--global-batch-size", "0"], 1, "--global-batch-size 0 must be >= 1"),
        (["--global-batch-size", "-4"], 1, "--global-batch-size -4 must be >= 1"),
        (["--micro-batch-size", "0"], 1, "--micro-batch-size 0 must be >= 1"),
        (["--micro-batch-size", "-2"], 1, "--micro-batch-size -2 must be >= 1"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "3", "--micro-batch-size", "1"], 2, "multiple of --pipeline-model-parallel-size"),
        (["--residual", "attnres", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
          "1", "--global-batch-size", "2", "--micro-batch-size", "1"], 2, "need at least 2 x"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "3", "--num-layers", "4"], 1,
         "--recompute-num-layers 3 does not divide the 4 layers of a pipeline chunk, which --recompute-method "
         "uniform needs with --residual standard; pick a divisor of 4, or --recompute-method block"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "2", "--num-layers", "8",
          "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
         "does not divide the 1 layers of a pipeline chunk"),
        (["--fused-single-qkv-rope"], 1, "leaves no place for the query/key norms; add --no-qk-layernorm"),
        pytest.param(["--fused-single-qkv-rope", "--no-qk-layernorm"], 1, "Transformer Engine is not installed; "
                     "install it, or drop the flag", marks=pytest.mark.skipif(
                         importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")),
        (["--cuda-graph-impl", "transformer_engine"], 1, "unknown --cuda-graph-impl 'transformer_engine'"),
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"], 1, "unknown --cuda-graph-scope 'attn'"),
        (["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "0"], 1, "--cuda-graph-warmup-steps 0 must be"),
        (["--cuda-graph-impl", "local"], 2, "launch one process, or drop --cuda-graph-impl local"),
        (["--cuda-graph-impl", "local", "--recompute-granularity", "full"], 1, "drop one of them"),
        (["--cuda-graph-impl", "local", "--hidden-dropout", "0.1"], 1, "set --hidden-dropout 0 --attention-dropout 0"),
        (["--cuda-graph-impl", "local", "--attention-backend", "unfused"], 1, "--attention-backend sdpa"),
        (["--cuda-graph-impl", "local", "--num-experts", "4"], 1, "drop --num-experts or the flag"),
        (["--cuda-graph-impl", "local", "--deepspeed", "--deepspeed-config", "x.json"], 1, "drop --deepspeed"),
        (["--lr-decay-style", "WSD", "--train-iters", "100", "--lr-warmup-iters", "10", "--lr-wsd-decay-iters", "0"],
         1, "--lr-wsd-decay-iters 0 must lie in 1..90"),
        (["--lr-decay-style", "WSD", "--train-iters", "100", "--lr-warmup-iters", "10", "--lr-wsd-decay-iters",
          "1000"], 1, "--lr-wsd-decay-iters 1000 must lie in 1..90 (the decay length 100 less the 10 warm-up"),
    ],
)
def test_bad_configuration_names_the_fix(flags, world, message):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + flags).validate(world)
    assert message in str(err.value)


def test_good_configurations_pass():
    parse_args(BASE + ["--residual", "attnres", "--attnres-num-blocks", "3"]).validate(1)
    for flags in (["--residual", "attnres", "--recompute-num-layers", "3"],  # the depth-mixing block's last group
                  ["--recompute-num-layers", "3", "--recompute-method", "block"], ["--recompute-num-layers", "2"]):
        parse_args(BASE + ["--recompute-granularity", "full"] + flags).validate(1)
    parse_args(BASE + ["--residual", "dca", "--dca-last-k", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"]).validate(4)
    parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                       "--global-batch-size", "4", "--micro-batch-size", "1"]).validate(2)
    cfg = parse_args(BASE + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel", "--seq-length", "32"]).validate(8)
    assert cfg.data_parallel_size(8) == 2
    cfg = parse_args(BASE + ["--num-experts", "4", "--moe-layer-freq", "([0]*1+[1]*3)", "--expert-model-parallel-size",
                             "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]).validate(4)
    assert cfg.decoder_config().moe_layer_pattern == [0, 1, 1, 1]
    assert parse_args(BASE + ["--num-experts", "2", "--moe-layer-freq", "2"]).decoder_config().moe_layer_pattern == \
        [1, 0, 1, 0]
    cfg = parse_args(BASE + ["--residual", "attnres", "--cuda-graph-impl", "local"]).validate(1)
    assert (cfg.training.cuda_graph_scope, cfg.training.cuda_graph_warmup_steps) == ("full_iteration", 3)


def test_cli_rejects_bad_input_before_any_work():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "mega_depth.train"] + BASE + ["--residual", "hyper"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "configuration error: unknown --residual 'hyper'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mega_depth.train", "--no-such-flag"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_xla_entry_point_without_torch_xla_and_with_megatron_only_flags():
    """torch-xla is imported only on the XLA path: here (no torch-xla) the entry point says how to get it; flags
    that only the Megatron trainer uses are refused by name."""
    env = dict(os.environ, PYTHONPATH=ROOT)

    def xla_train(*flags):
        return subprocess.run([sys.executable, "-m", "mega_depth.xla.train"] + BASE + list(flags),
                              capture_output=True, text=True, env=env, timeout=120)

    proc = xla_train()
    assert proc.returncode == 2 and "torch-xla is not installed" in proc.stderr and "--device cpu" in proc.stderr
    proc = xla_train("--tensor-model-parallel-size", "2", "--deepspeed")
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size, --deepspeed: Megatron-trainer options" in proc.stderr and "--mesh" in proc.stderr
    proc = xla_train("--context-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "2")
    assert proc.returncode == 2
    assert "--context-parallel-size, --expert-model-parallel-size: Megatron-trainer options" in proc.stderr
    proc = xla_train("--device", "cpu", "--mesh", "2,1")
    assert proc.returncode == 2 and "--mesh needs --device xla" in proc.stderr


@pytest.mark.parametrize("text, message", [
    ("model:\n  num_layers: 2.9\n", "model.num_layers in {path} must be an integer, got 2.9 (float)"),
    ("model:\n  num_layers: true\n", "model.num_layers in {path} must be an integer, got True (bool)"),
    ("model:\n  num_layers: [4]\n", "model.num_layers in {path} must be an integer, got [4] (list)"),
    ("training:\n  lr: fast\n", "training.lr in {path} must be a number, got 'fast' (str)"),
    ("training:\n  deepspeed: 1\n", "training.deepspeed in {path} must be true or false, got 1 (int)"),
    ("residual:\n  mechanism: 3\n", "residual.mechanism in {path} must be a string (quote it: '...'), got 3"),
    ("data:\n  data_path: docs\n", "data.data_path in {path} must be a list of strings, got 'docs'"),
    ("model:\n  num_layers: null\n", "model.num_layers in {path} cannot be empty (null)"),
    ("model:\n  - num_layers\n  - 4\n", "section 'model' in {path} must map keys to values"),
    ("model: 4\n", "section 'model' in {path} must map keys to values"),
    ("- model\n", "must map section names"),
])
def test_yaml_values_of_the_wrong_type_are_errors_not_casts(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert message.format(path=path) in str(err.value)


def test_yaml_numbers_keep_their_meaning():
    """Integers where floats belong, and YAML 1.1's 3e-4 (read as a string), are numbers."""
    import tempfile

    from mega_depth.config import Config, load_yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write("training:\n  lr: 3e-4\n  weight_decay: 0\nmodel:\n  num_layers: 6\n")
        f.flush()
        cfg = load_yaml(f.name, Config())
    assert cfg.training.lr == 3e-4 and cfg.training.weight_decay == 0.0 and cfg.model.num_layers == 6
    assert isinstance(cfg.training.weight_decay, float)


def test_unreadable_config_files_and_a_file_for_a_folder_are_one_line(tmp_path):
    """The bad-input rows that were tracebacks: a --config with a non-UTF-8 byte or naming a directory, --save or
    --output-dir naming a file, a truncated .idx, and preprocessing lines whose text is not a string."""
    (tmp_path / "latin1.yaml").write_bytes(b"model:\n  num_layers: \xff4\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text \(byte 0xff at offset 21\)"):
        parse_args(["--mock-data", "--config", str(tmp_path / "latin1.yaml")])
    with pytest.raises(ConfigError, match="is a directory; give the YAML file inside it"):
        parse_args(["--mock-data", "--config", str(tmp_path)])
    (tmp_path / "afile").write_text("x")
    for flag in ("--save", "--output-dir"):
        with pytest.raises(ConfigError, match=f"{flag} .*afile is a file, not a folder"):
            parse_args(["--mock-data", flag, str(tmp_path / "afile")]).validate()


def test_a_truncated_index_and_text_that_is_not_a_string_are_one_line(data, tmp_path):
    import shutil

    from mega_depth.data.datasets import check_indexed_dataset
    from mega_depth.data.text import load_text_dataset

    prefix = str(tmp_path / "docs")
    shutil.copy(data["dir"] / "docs.bin", prefix + ".bin")
    shutil.copy(data["dir"] / "docs.idx", prefix + ".idx")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"docs.idx is truncated \(100 bytes, its header describes \d+ sequences\)"):
        check_indexed_dataset(prefix, None)
    for value, kind in (("null", "null"), ("7", "int"), ('["a"]', "list"), ('{"a": 1}', "dict")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text('{"text": "fine"}\n{"text": %s}\n' % value)
        with pytest.raises(ValueError, match=rf"{kind}.jsonl:2: 'text' is {kind} \(.*\), not a string"):
            load_text_dataset([str(path)])


def test_dry_run_reads_a_bad_deepspeed_config_as_one_line(tmp_path):
    """--dry-run sizes a DeepSpeed run from its config's ZeRO stage: a missing, unreadable or malformed file is the
    trainer's one line, not a traceback."""
    from mega_depth.training.dry_run import _zero_stage

    (tmp_path / "bad.json").write_text("{stage")
    (tmp_path / "ok.json").write_text('{"zero_optimization": {"stage": 2}}')
    for path, message in ((tmp_path / "nowhere.json", "does not exist"), (tmp_path / "bad.json", "is not valid JSON"),
                          (tmp_path, "is a folder, not a JSON file")):
        cfg = parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(path)])
        with pytest.raises(ConfigError, match=f"--deepspeed-config {path} {message}"):
            _zero_stage(cfg)
    assert _zero_stage(parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "ok.json")])) == 2
    # DeepSpeed's own precision and schedule blocks would train another model than the one the run records
    for block, message in (('"fp16": {"enabled": true}', 'the "fp16" block is not supported: remove it and use --bf16'),
                           ('"scheduler": {"type": "WarmupLR"}', 'the "scheduler" block is not supported')):
        (tmp_path / "own.json").write_text('{"zero_optimization": {"stage": 1}, %s}' % block)
        with pytest.raises(ConfigError, match=message):
            _zero_stage(parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "own.json")]))
    (tmp_path / "off.json").write_text('{"fp16": {"enabled": false}, "bf16": {"enabled": false}}')
    assert _zero_stage(parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "off.json")])) == 0
    from mega_depth.training.backends.deepspeed import ds_config

    (tmp_path / "bf16.json").write_text('{"bf16": {"enabled": true}}')
    with pytest.raises(ConfigError, match='"bf16" is enabled there but the run is fp32: pass --bf16'):
        ds_config(parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "bf16.json")]), 1, 1)
    bf16_run = parse_args(BASE + ["--bf16", "--deepspeed", "--deepspeed-config", str(tmp_path / "bf16.json")])
    agreeing = ds_config(bf16_run, 1, 1)
    assert agreeing["bf16"] == {"enabled": True}
    assert ds_config(parse_args(BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "off.json")]), 1,
                     1)["bf16"] == {"enabled": False}


def test_a_deepspeed_config_that_disagrees_with_the_runs_flags_is_refused(tmp_path):
    """The flags own the batch, the clip and the optimizer's settings (the run records them): a file that sets one
    to another value was overwritten without a word; the same value, or HF's "auto", is fine."""
    from mega_depth.training.backends.deepspeed import ds_config

    run = BASE + ["--deepspeed", "--deepspeed-config", str(tmp_path / "ds.json"), "--micro-batch-size", "2",
                  "--global-batch-size", "8", "--clip-grad", "1.0", "--lr", "3e-4"]
    for block, message in (
            ('"train_batch_size": 16', "train_batch_size is 16, but the run's flags (--global-batch-size and "
                                       "--micro-batch-size) give 8; remove it from the file"),
            ('"gradient_accumulation_steps": 1', "gradient_accumulation_steps is 1, but the run's flags (--global-batch"),
            ('"gradient_clipping": 0.5', "gradient_clipping is 0.5, but the run's flags (--clip-grad) give 1.0"),
            ('"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}', "optimizer.params.lr is 0.001, but the "
                                                                        "run's flags (--lr) give 0.0003"),
            ('"optimizer": {"params": {"betas": [0.9, 0.999]}}', "optimizer.params.betas is [0.9, 0.999]")):
        (tmp_path / "ds.json").write_text("{%s}" % block)
        with pytest.raises(ConfigError, match=re.escape(message)):
            ds_config(parse_args(run), 2, 2)
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "gradient_accumulation_steps": "auto", '
                                      '"gradient_clipping": 1, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}')
    ds = ds_config(parse_args(run), 2, 2)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 1.0


def test_text_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path):
    """A Latin-1 byte in a corpus ended train_tokenizer / preprocess_data in a traceback from inside pyarrow while
    the rows were read; now the file's check names the line and the fix (JSON lines, plain text, gzip)."""
    import gzip

    from mega_depth.data.text import load_text_dataset

    body = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'
    (tmp_path / "latin.jsonl").write_bytes(body)
    (tmp_path / "latin.txt").write_bytes(b"fine\ncaf\xe9\n")
    with gzip.open(tmp_path / "latin.jsonl.gz", "wb") as f:
        f.write(body)
    for name, column in (("latin.jsonl", 14), ("latin.txt", 4), ("latin.jsonl.gz", 14)):
        with pytest.raises(ValueError, match=rf"{name}:2 is not UTF-8 text \(byte 0xe9 at column {column}\); "
                                             "convert the file to UTF-8"):
            load_text_dataset([str(tmp_path / name)])


def test_a_json_key_that_a_line_lacks_is_an_empty_text_not_the_word_none(tmp_path):
    from mega_depth.data.text import load_text_dataset

    path = tmp_path / "docs.jsonl"
    path.write_text('{"title": "A title", "text": "a body"}\n{"text": "no title here"}\n{"title": "no body"}\n')
    joined = load_text_dataset([str(path)], ["title", "text"])
    assert joined["text"] == ["A title\n\na body", "no title here", "no body"]
    assert load_text_dataset([str(path)], ["text"])["text"] == ["a body", "no title here", None]  # (encoded as "")
