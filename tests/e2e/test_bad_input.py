"""Bad input gets one clear line that names the problem and the fix, exit status 2, no traceback, and nothing left
half-written: data files, configs, checkpoints, CLI flags, and every tool's input."""

import os
import shutil

import pytest

from fixtures import CORPUS, TRAIN_MODEL, run


def assert_clean_error(proc, expected):
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    run(["-m", "mega_depth.train"] + TRAIN_MODEL + data["flags"] + ["--train-iters", "3", "--save", str(d / "ckpt"),
                                                                   "--no-tensorboard", "--output-dir", str(d / "run")])
    return d


TRAINER_CASES = {
    "missing-idx": "does not exist; build",
    "corrupt-idx": "is not a Megatron indexed-dataset index",
    "truncated-bin": "truncated or mismatched",
    "tokenizer-mismatch": "the data was made with another tokenizer",
    "other-mechanism": "--residual: checkpoint 'attnres', this run 'dca'",
    "other-shape": "--hidden-size: checkpoint 32, this run 64",
    "unknown-config-key": "unknown key model.num_layer",
    "not-a-checkpoint": "holds no checkpoint",
    "negative-lr": "--lr -0.1 must be positive",
    "bad-choice-in-yaml": "unknown --attnres-query 'dynamic'; choose one of static, input",
    "deepspeed-config-missing": "--deepspeed-config /nowhere.json does not exist",
    "negative-global-batch": "--global-batch-size -4 must be >= 1",
    "sequence-longer-than-the-data": "--seq-length 2000000 needs 2000001 tokens per sample, but the training split",
    "yaml-float-for-int": "model.num_layers in",
    "yaml-list-for-section": "section 'training' in",
}


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_trainer_bad_input(data, saved, tmp_path, case):
    d = data["dir"]
    flags = TRAIN_MODEL + data["flags"] + ["--train-iters", "3", "--output-dir", str(tmp_path / "run")]
    if case in ("missing-idx", "corrupt-idx", "truncated-bin"):
        prefix = tmp_path / "copy"
        shutil.copy(d / "docs.bin", str(prefix) + ".bin")
        shutil.copy(d / "docs.idx", str(prefix) + ".idx")
        if case == "missing-idx":
            os.remove(str(prefix) + ".idx")
        elif case == "corrupt-idx":
            with open(str(prefix) + ".idx", "r+b") as f:
                f.write(b"GARBAGE!!")
        else:
            with open(str(prefix) + ".bin", "r+b") as f:
                f.truncate(os.path.getsize(str(prefix) + ".bin") - 10)
        flags += ["--data-path", str(prefix)]
    elif case == "tokenizer-mismatch":
        run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "700", "--output-prefix",
             str(tmp_path / "small")])
        flags += ["--tokenizer-model", str(tmp_path / "small.model")]
    elif case == "other-mechanism":
        flags += ["--residual", "dca", "--load", str(saved / "ckpt")]
    elif case == "other-shape":
        flags += ["--hidden-size", "64", "--load", str(saved / "ckpt")]
    elif case == "unknown-config-key":
        (tmp_path / "c.yaml").write_text("model:\n  num_layer: 4\n")
        flags += ["--config", str(tmp_path / "c.yaml")]
    elif case == "not-a-checkpoint":
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
        flags += ["--load", str(tmp_path / "junk")]
    elif case == "negative-lr":
        flags += ["--lr", "-0.1"]
    elif case == "negative-global-batch":
        flags += ["--global-batch-size", "-4"]
    elif case == "sequence-longer-than-the-data":
        flags += ["--seq-length", "2000000"]
    elif case == "yaml-float-for-int":
        (tmp_path / "c.yaml").write_text("model:\n  num_layers: 2.9\n")
        flags += ["--config", str(tmp_path / "c.yaml")]
    elif case == "yaml-list-for-section":
        (tmp_path / "c.yaml").write_text("training:\n  - lr\n")
        flags += ["--config", str(tmp_path / "c.yaml")]
    elif case == "bad-choice-in-yaml":
        (tmp_path / "c.yaml").write_text("residual:\n  mechanism: attnres\n  attnres_query: dynamic\n")
        flags += ["--config", str(tmp_path / "c.yaml")]
    else:
        flags += ["--deepspeed", "--deepspeed-config", "/nowhere.json"]
    proc = run(["-m", "mega_depth.train"] + flags, expect=2)
    assert_clean_error(proc, TRAINER_CASES[case])
    if case == "unknown-config-key":
        assert "did you mean model.num_layers?" in proc.stderr
    if case == "yaml-float-for-int":
        assert "must be an integer, got 2.9 (float)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line


def test_preprocess_bad_json_lines_and_empty_input(data, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    spm = str(data["dir"] / "spm.model")
    for name, expected in (("bad", "bad.jsonl:2 is not valid JSON"), ("empty", "empty.jsonl is empty"),
                           ("blank", "tokenized to no tokens at all")):
        proc = run(["tools/preprocess_data.py", "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                    str(tmp_path / f"out-{name}"), "--tokenizer-model", spm], expect=2)
        assert_clean_error(proc, expected)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out-")]  # nothing half-written


def test_train_tokenizer_empty_input_and_impossible_vocabulary(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "small.jsonl").write_text('{"text": "a short text of a few words"}\n')
    proc = run(["tools/train_tokenizer.py", "--input", str(tmp_path / "empty.jsonl"), "--vocab-size", "100",
                "--output-prefix", str(tmp_path / "a")], expect=2)
    assert_clean_error(proc, "empty.jsonl is empty")
    proc = run(["tools/train_tokenizer.py", "--input", str(tmp_path / "small.jsonl"), "--vocab-size", "8000",
                "--output-prefix", str(tmp_path / "b")], expect=2)
    assert_clean_error(proc, "--vocab-size 8000 is too large for this text: sentencepiece can make at most")
    proc = run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "300", "--output-prefix",
                str(tmp_path / "c")], expect=2)
    assert_clean_error(proc, "--vocab-size 300 is too small for this text")
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "small.jsonl"]  # no model left behind


def test_convert_from_hf_on_a_folder_that_is_no_model(tmp_path):
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "x.txt").write_text("hello")
    proc = run(["tools/convert_from_hf.py", "--hf", str(tmp_path / "random"), "--save", str(tmp_path / "out")],
               expect=2)
    assert_clean_error(proc, "is not a Hugging Face model folder (no config.json) nor a mega_depth checkpoint")
    assert not (tmp_path / "out").exists()
