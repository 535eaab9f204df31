"""Tests for shared/data.py: corpus loading, splits, shards, samplers, eval batches."""

import os
import pathlib
import sysconfig

import numpy as np
import pytest

from shared.data import (
    BatchSampler,
    CorpusError,
    CorpusSplit,
    default_corpus_files,
    eval_batches,
    load_corpus,
    shard_for_unit,
    split_corpus,
)

SEQ_LEN = 16


@pytest.fixture(scope="module")
def split() -> CorpusSplit:
    # Pseudo-random bytes: every window is (almost surely) unique, so "where did this window
    # come from" checks below are meaningful.
    data = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint8).tobytes()
    return split_corpus(data, heldout_fraction=0.05)


def occurs_in(window: np.ndarray, data: np.ndarray) -> bool:
    """Whether `window` appears as a contiguous run of `data`."""
    return window.astype(np.uint8).tobytes() in data.tobytes()


def test_split_is_head_and_tail(split):
    assert split.train.dtype == split.heldout.dtype == np.uint8
    assert len(split.train) + len(split.heldout) == 20_000
    assert len(split.heldout) == 1_000
    again = split_corpus(split.train.tobytes() + split.heldout.tobytes(), heldout_fraction=0.05)
    assert np.array_equal(again.train, split.train)
    assert np.array_equal(again.heldout, split.heldout)
    with pytest.raises(ValueError):
        split_corpus(b"abc", heldout_fraction=1.0)


@pytest.mark.parametrize("num_units", [1, 3, 7])
def test_shards_are_disjoint_and_cover_train(split, num_units):
    shards = [shard_for_unit(split.train, u, num_units) for u in range(num_units)]
    # Contiguous and in order: concatenating them gives back train exactly, so they are disjoint
    # and cover it.
    assert np.array_equal(np.concatenate(shards), split.train)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    # Same call, same slice.
    assert np.array_equal(shard_for_unit(split.train, 0, num_units), shards[0])


def test_shard_validates_unit(split):
    for unit, num_units in [(-1, 4), (4, 4), (0, 0)]:
        with pytest.raises(ValueError):
            shard_for_unit(split.train, unit, num_units)
    with pytest.raises(CorpusError):
        shard_for_unit(split.train[:3], 0, 4)


def test_sampler_is_deterministic_per_seed_unit_step(split):
    shard = shard_for_unit(split.train, 1, 4)
    a = BatchSampler(shard, SEQ_LEN, batch_size=8, seed=42, unit=1)
    b = BatchSampler(shard, SEQ_LEN, batch_size=8, seed=42, unit=1)
    batch = a.batch(5)
    assert batch.shape == (8, SEQ_LEN + 1) and batch.dtype == np.int32
    # A "restarted" sampler resumes at any step with identical data, regardless of call order.
    assert np.array_equal(b.batch(5), batch)
    assert np.array_equal(a.batch(5), batch)
    assert not np.array_equal(a.batch(6), batch)
    assert not np.array_equal(BatchSampler(shard, SEQ_LEN, 8, seed=43, unit=1).batch(5), batch)


def test_sampler_differs_across_units_and_stays_in_shard(split):
    num_units = 4
    batches = []
    for unit in range(num_units):
        shard = shard_for_unit(split.train, unit, num_units)
        sampler = BatchSampler(shard, SEQ_LEN, batch_size=16, seed=0, unit=unit)
        for step in range(3):
            batch = sampler.batch(step)
            assert batch.min() >= 0 and batch.max() < 256
            for row in batch:
                assert occurs_in(row, shard)
        batches.append(sampler.batch(0))
    for i in range(num_units):
        for j in range(i + 1, num_units):
            assert not np.array_equal(batches[i], batches[j])


def test_sampler_rejects_too_small_shard():
    with pytest.raises(CorpusError):
        BatchSampler(np.zeros(SEQ_LEN, dtype=np.uint8), SEQ_LEN, batch_size=2, seed=0, unit=0)
    # Exactly one window is enough.
    one = BatchSampler(np.arange(SEQ_LEN + 1, dtype=np.uint8), SEQ_LEN, 3, seed=0, unit=0)
    assert np.array_equal(one.batch(0), np.tile(np.arange(SEQ_LEN + 1), (3, 1)))


def test_eval_batches_are_fixed_and_from_heldout(split):
    batches = eval_batches(split.heldout, SEQ_LEN, batch_size=4, num_batches=5)
    assert batches.shape == (5, 4, SEQ_LEN + 1) and batches.dtype == np.int32
    assert np.array_equal(eval_batches(split.heldout, SEQ_LEN, 4, 5), batches)
    flat = batches.reshape(-1, SEQ_LEN + 1)
    assert all(occurs_in(row, split.heldout) for row in flat)
    # Evenly spaced: starts at the beginning, ends at the very end of the held-out data.
    assert np.array_equal(flat[0], split.heldout[: SEQ_LEN + 1])
    assert np.array_equal(flat[-1], split.heldout[-(SEQ_LEN + 1) :])
    with pytest.raises(CorpusError):
        eval_batches(split.heldout[:SEQ_LEN], SEQ_LEN, 1, 1)


def test_load_corpus_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"hello world\n")
    assert load_corpus(path) == b"hello world\n"
    assert load_corpus(str(path), max_bytes=5) == b"hello"
    with pytest.raises(CorpusError, match="too small"):
        load_corpus(path, min_bytes=1000)


def test_load_corpus_folder(tmp_path):
    (tmp_path / "b.py").write_bytes(b"bbb")
    (tmp_path / "a.txt").write_bytes(b"aaa")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"ccc")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")  # skipped: contains NUL
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: hidden")  # skipped: hidden directory
    # Sorted by path, joined with newlines.
    assert load_corpus(tmp_path) == b"aaa\nbbb\nccc"
    assert load_corpus(tmp_path, max_bytes=5) == b"aaa\nb"


def test_a_folder_corpus_keeps_regular_files_in_path_order_and_follows_no_folder_link(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_bytes(b"x")
    (tmp_path / "a-b.txt").write_bytes(b"-")  # after a/x.txt: sorted by the path's parts
    (tmp_path / ".dotfile").write_bytes(b".")  # a hidden file is kept, a hidden folder is not
    (tmp_path / "link.txt").symlink_to(tmp_path / "a-b.txt")  # a link to a file is read
    (tmp_path / "loop").symlink_to(tmp_path / "a")  # a link to a folder is not followed
    (tmp_path / "broken").symlink_to(tmp_path / "missing")
    os.mkfifo(tmp_path / "fifo")  # never opened: reading it would block
    assert load_corpus(tmp_path) == b".\nx\n-\n-"


def test_load_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty_dir)
    (empty_dir / "blob.bin").write_bytes(b"\x00")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty_dir)
    empty_file = tmp_path / "empty.txt"
    empty_file.write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(empty_file)
    assert issubclass(CorpusError, ValueError)


def test_default_corpus_is_stdlib_source_and_deterministic():
    files = default_corpus_files()
    assert files and files == default_corpus_files()
    assert all(f.suffix == ".py" for f in files)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    relative_parts = {part for f in files for part in f.relative_to(stdlib).parts}
    assert not relative_parts & {"site-packages", "dist-packages"}
    assert any(f.name == "os.py" for f in files)
    data = load_corpus(max_bytes=200_000)
    assert len(data) == 200_000
    assert load_corpus(max_bytes=200_000) == data
