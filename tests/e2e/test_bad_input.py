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


def _data_copy(damage):
    """Flags for a copy of the test corpus, damaged by `damage(prefix)`."""
    def make(data, saved, tmp):
        prefix = tmp / "copy"
        shutil.copy(data["dir"] / "docs.bin", str(prefix) + ".bin")
        shutil.copy(data["dir"] / "docs.idx", str(prefix) + ".idx")
        damage(str(prefix))
        return ["--data-path", str(prefix)]
    return make


def _yaml(text):
    def make(data, saved, tmp):
        (tmp / "c.yaml").write_text(text)
        return ["--config", str(tmp / "c.yaml")]
    return make


def _other_tokenizer(data, saved, tmp):
    run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "700", "--output-prefix", str(tmp / "small")])
    return ["--tokenizer-model", str(tmp / "small.model")]


def _junk_folder(data, saved, tmp):
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.txt").write_text("not a checkpoint")
    return ["--load", str(tmp / "junk")]


def _truncate(path, by):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


def _overwrite_start(path, data):
    with open(path, "r+b") as f:
        f.write(data)


def _flags(*flags):
    return lambda data, saved, tmp: list(flags)


# case: (the flags it adds to a good run, made in its own tmp folder; the message it must get)
TRAINER_CASES = {
    "missing-idx": (_data_copy(lambda p: os.remove(p + ".idx")), "does not exist; build"),
    "corrupt-idx": (_data_copy(lambda p: _overwrite_start(p + ".idx", b"GARBAGE!!")),
                    "is not a Megatron indexed-dataset index"),
    "truncated-bin": (_data_copy(lambda p: _truncate(p + ".bin", 10)), "truncated or mismatched"),
    "tokenizer-mismatch": (_other_tokenizer, "the data was made with another tokenizer"),
    "other-mechanism": (lambda data, saved, tmp: ["--residual", "dca", "--load", str(saved / "ckpt")],
                        "--residual: checkpoint 'attnres', this run 'dca'"),
    "other-shape": (lambda data, saved, tmp: ["--hidden-size", "64", "--load", str(saved / "ckpt")],
                    "--hidden-size: checkpoint 32, this run 64"),
    "unknown-config-key": (_yaml("model:\n  num_layer: 4\n"),
                           "unknown key model.num_layer in {tmp}/c.yaml; did you mean model.num_layers?"),
    "not-a-checkpoint": (_junk_folder, "holds no checkpoint"),
    "negative-lr": (_flags("--lr", "-0.1"), "--lr -0.1 must be positive"),
    "bad-choice-in-yaml": (_yaml("residual:\n  mechanism: attnres\n  attnres_query: dynamic\n"),
                           "unknown --attnres-query 'dynamic'; choose one of static, input"),
    "deepspeed-config-missing": (_flags("--deepspeed", "--deepspeed-config", "/nowhere.json"),
                                 "--deepspeed-config /nowhere.json does not exist"),
    "negative-global-batch": (_flags("--global-batch-size", "-4"), "--global-batch-size -4 must be >= 1"),
    "sequence-longer-than-the-data": (_flags("--seq-length", "2000000"),
                                      "--seq-length 2000000 needs 2000001 tokens per sample, but the training split"),
    "validation-split-without-documents": (_flags("--split", "1000,1,0", "--eval-interval", "2"),
                                           "the validation split of"),
    "yaml-float-for-int": (_yaml("model:\n  num_layers: 2.9\n"),
                           "model.num_layers in {tmp}/c.yaml must be an integer, got 2.9 (float)"),
    "context-parallel-on-one-process": (_flags("--context-parallel-size", "2"),
                                        "world size 1 is not divisible by TP x CP x PP = 1 x 2 x 1"),
    "moe-topk-above-the-experts": (_flags("--num-experts", "2", "--moe-router-topk", "3"),
                                   "--moe-router-topk 3 must lie in 1..--num-experts (2)"),
    "yaml-list-for-section": (_yaml("training:\n  - lr\n"), "section 'training' in {tmp}/c.yaml must map keys"),
}


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_trainer_bad_input(data, saved, tmp_path, case):
    make_flags, expected = TRAINER_CASES[case]
    flags = TRAIN_MODEL + data["flags"] + ["--train-iters", "3", "--output-dir", str(tmp_path / "run")]
    proc = run(["-m", "mega_depth.train"] + flags + make_flags(data, saved, tmp_path), expect=2)
    assert_clean_error(proc, expected.format(tmp=tmp_path))
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_preprocess_bad_json_lines_and_empty_input(data, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    (tmp_path / "null.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    spm = str(data["dir"] / "spm.model")
    for name, expected in (("bad", "bad.jsonl:2 is not valid JSON"), ("empty", "empty.jsonl is empty"),
                           ("blank", "tokenized to no tokens at all"), ("null", "null.jsonl:2: 'text' is null")):
        proc = run(["tools/preprocess_data.py", "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix",
                    str(tmp_path / f"out-{name}"), "--tokenizer-model", spm], expect=2)
        assert_clean_error(proc, expected)
    # with --append-eod too: an empty text is no document, not an EOD alone (Megatron-LM's rule)
    proc = run(["tools/preprocess_data.py", "--input", str(tmp_path / "blank.jsonl"), "--output-prefix",
                str(tmp_path / "out-blank-eod"), "--tokenizer-model", spm, "--append-eod"], expect=2)
    assert_clean_error(proc, "tokenized to no tokens at all")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out-")]  # nothing half-written


def test_preprocessing_with_a_tokenizer_retrained_at_the_same_path_writes_its_ids(tmp_path):
    """datasets caches the tokenized corpus by the map function, which names the model by its path: the ids must
    follow the model's bytes, or a retrained tokenizer would get the old one's ids back."""
    import numpy as np
    import sentencepiece as spm

    (tmp_path / "in.jsonl").write_text("".join(f'{{"text": "document {i} says the quick brown fox jumps"}}\n'
                                               for i in range(40)))
    text = tmp_path / "plain.txt"
    text.write_text("\n".join(f"document {i} says the quick brown fox jumps" for i in range(40)))
    model = tmp_path / "tok.model"
    for vocab in (40, 60):  # two tokenizers, one path
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / f"v{vocab}"), vocab_size=vocab,
                                       hard_vocab_limit=False, minloglevel=2)
        shutil.copy(tmp_path / f"v{vocab}.model", model)
        run(["tools/preprocess_data.py", "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
             str(tmp_path / f"out{vocab}"), "--tokenizer-model", str(model)])
    sp = spm.SentencePieceProcessor(model_file=str(model))
    written = np.fromfile(tmp_path / "out60.bin", dtype=np.uint16)
    expected = [i for k in range(40) for i in sp.encode(f"document {k} says the quick brown fox jumps")]
    assert written.tolist() == expected


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
