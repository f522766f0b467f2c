"""The data position of a run is its consumed samples: a global batch of any size, in any layout, takes the next
samples after them; checkpoints written before the count existed derive it from their step and global batch.
Metrics records are strict JSON."""

import json
import math

from mega_depth.data.datasets import GlobalBatchSampler
from mega_depth.training.logger import strict_json
from mega_depth.training.trainer import consumed_samples

DATA = [{"tokens": [i], "labels": [i], "loss_mask": [1], "position_ids": [0]} for i in range(200)]


def global_batch(layout, consumed):
    """Sample ids of the global batch after `consumed`, gathered over every data-parallel rank."""
    mbs, nmb, dp = layout
    ids = []
    for rank in range(dp):
        for mb in GlobalBatchSampler(DATA, mbs, nmb, dp, rank).microbatches_from(consumed):
            ids += mb["tokens"].flatten().tolist()
    return ids


def test_changing_the_global_batch_or_the_layout_continues_after_the_last_consumed_sample():
    consumed, seen = 0, []
    # global batch 4 (DP 2), then 8 (DP 2, mbs 2), then 6 (DP 3), then 4 on one rank: resumes in between
    for layout, steps in (((1, 2, 2), 3), ((2, 2, 2), 2), ((1, 2, 3), 2), ((2, 2, 1), 3)):
        gbs = layout[0] * layout[1] * layout[2]
        for _ in range(steps):
            batch = global_batch(layout, consumed)
            assert sorted(batch) == list(range(consumed, consumed + gbs))
            seen += batch
            consumed += gbs
    assert sorted(seen) == list(range(consumed)) and len(seen) == len(set(seen))


def test_every_layout_of_one_global_batch_reads_the_same_samples():
    for consumed in (0, 12, 36):
        assert sorted(global_batch((1, 8, 1), consumed)) == sorted(global_batch((2, 2, 2), consumed)) \
            == sorted(global_batch((1, 2, 4), consumed))


def test_consumed_samples_of_old_and_new_checkpoints():
    assert consumed_samples({"consumed_samples": 20, "config": {"training": {"global_batch_size": 8}}}, 3) == 20
    # before the count was recorded: every step took the recorded global batch ...
    assert consumed_samples({"config": {"training": {"global_batch_size": 8}}}, 3) == 24
    # ... or, left to its default, one micro-batch per data-parallel rank
    assert consumed_samples({"config": {"training": {"global_batch_size": None, "micro_batch_size": 2}},
                             "layout": {"dp": 4}}, 3) == 24


def test_metrics_records_are_strict_json():
    record = {"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3}
    line = json.dumps(strict_json(record), allow_nan=False)
    back = json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert back == {"step": 3, "loss": None, "grad_norm": None, "lr": 1e-3,
                    "nonfinite": {"loss": "nan", "grad_norm": "inf"}}
    finite = {"step": 4, "loss": 2.5}
    assert strict_json(finite) is finite and not any(math.isnan(v) for v in finite.values())


def test_each_later_epoch_has_an_order_of_its_own():
    """The first epoch is the dataset's own order; each later one a permutation of its own, the same in every
    process (a second epoch replayed the first batch by batch)."""
    sampler = GlobalBatchSampler(DATA[:10], 1, 1, 1, 0)
    epochs = [[sampler.index(i) for i in range(10 * e, 10 * (e + 1))] for e in range(4)]
    assert epochs[0] == list(range(10))
    assert all(sorted(order) == list(range(10)) for order in epochs)
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1]
    again = GlobalBatchSampler(DATA[:10], 1, 1, 1, 0)
    assert [again.index(i) for i in range(40)] == [i for order in epochs for i in order]


def test_the_sample_order_does_not_depend_on_how_many_samples_a_run_asks_for(data):
    """Megatron shuffles its document index over all the epochs it builds: a resume with a longer --train-iters (or
    another global batch) asked for more samples and reordered every sample trained on. One epoch is built for
    any count."""
    import torch

    from fixtures import TRAIN_MODEL
    from mega_depth.config import parse_args
    from mega_depth.data.datasets import build_datasets, tokenizer_for
    from mega_depth.train import apply_tokenizer_vocab

    cfg = parse_args(TRAIN_MODEL + data["flags"])
    apply_tokenizer_vocab(cfg)
    cfg.validate(1)
    short = build_datasets(cfg, tokenizer_for(cfg), (8, None, None))[0]
    epoch = len(short)
    long = build_datasets(cfg, tokenizer_for(cfg), (3 * epoch + 5, None, None))[0]
    assert len(long) == epoch
    for i in (0, 1, epoch // 2, epoch - 1):
        assert torch.equal(torch.as_tensor(short[i]["tokens"]), torch.as_tensor(long[i]["tokens"]))


def test_blends_build_with_the_splits_a_run_samples(data):
    """A weighted blend (megatron asks a size of every split it builds) and an unweighted one whose test split
    holds no document (megatron's blend refuses a dataset of none) build the splits a run samples, and leave the
    others out."""
    from fixtures import TRAIN_MODEL
    from mega_depth.config import parse_args
    from mega_depth.data.datasets import build_datasets, tokenizer_for
    from mega_depth.train import apply_tokenizer_vocab

    docs = str(data["dir"] / "docs")
    for blend in (["1", docs, "2", docs], [docs, docs]):
        cfg = parse_args(TRAIN_MODEL + data["flags"] + ["--data-path", *blend, "--split", "969,30,1"])
        apply_tokenizer_vocab(cfg)
        cfg.validate(1)
        train, valid, test = build_datasets(cfg, tokenizer_for(cfg), (16, 8, None))
        assert len(train) >= 16 and len(valid) >= 8 and test is None
        assert build_datasets(cfg, tokenizer_for(cfg), (16, None, None))[1] is None


def test_the_index_cache_follows_the_data_files(tmp_path):
    """Megatron keys its cached sample indexes by path, count and split: a prefix preprocessed again must not get
    the old indexes back."""
    import os

    from mega_depth.data.datasets import _cache_folder

    prefix = tmp_path / "docs"
    (tmp_path / "docs.idx").write_bytes(b"x" * 10)
    (tmp_path / "docs.bin").write_bytes(b"x" * 100)
    first = _cache_folder(str(tmp_path / "cache"), [str(prefix)])
    assert first.startswith(str(tmp_path / "cache")) and _cache_folder(str(tmp_path / "cache"), [str(prefix)]) == first
    (tmp_path / "docs.idx").write_bytes(b"x" * 20)  # preprocessed again, with more documents
    second = _cache_folder(str(tmp_path / "cache"), [str(prefix)])
    (tmp_path / "docs.bin").write_bytes(b"x" * 90)  # ... or as many, of other tokens
    third = _cache_folder(str(tmp_path / "cache"), [str(prefix)])
    (tmp_path / "docs.idx").write_bytes(b"y" * 20)  # ... or as many documents of other lengths: sizes unchanged
    assert len({first, second, third, _cache_folder(str(tmp_path / "cache"), [str(prefix)])}) == 4
    assert _cache_folder(None, [str(prefix)]) is None and sorted(os.listdir(tmp_path)) == ["docs.bin", "docs.idx"]
