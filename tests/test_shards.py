"""Tests for data/shards.py: round trip, every corrupt-file case, write validation and atomicity, globbing, the
ids check against a vocabulary.

Shards are byte-exact data, so every comparison is exact (np.array_equal); no tolerances apply.
"""
import os
import re

import numpy as np
import pytest

from data import shards
from data.shards import (HEADER_BYTES, HEADER_INTS, MAGIC, VERSION, ShardError, check_token_ids, load_shard,
                         read_header, shard_files, write_shard)


def _raw_shard(path, header_ints, payload=b""):
    """Write a file with an arbitrary header (first ints given, rest zero) and payload, bypassing checks."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[: len(header_ints)] = header_ints
    path.write_bytes(header.tobytes() + payload)
    return path


def test_constants():
    assert (MAGIC, VERSION, HEADER_INTS, HEADER_BYTES) == (20240520, 1, 256, 1024)
    assert issubclass(ShardError, ValueError)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 65537])
def test_round_trip(tmp_path, n):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 65536, size=n, dtype=np.int64)
    tokens[0] = 65535
    if n > 1:
        tokens[-1] = 0
    path = tmp_path / "x.bin"
    write_shard(path, tokens)
    assert read_header(path) == n
    assert os.path.getsize(path) == HEADER_BYTES + 2 * n
    got = load_shard(path)
    assert got.dtype == np.uint16 and got.shape == (n,)
    assert np.array_equal(got, tokens)
    mm = load_shard(path, mmap=True)
    assert isinstance(mm, np.memmap) and mm.dtype == np.uint16 and mm.shape == (n,)
    assert np.array_equal(mm, got)
    assert not mm.flags.writeable


def test_byte_layout(tmp_path):
    """The bytes on disk are exactly the documented layout (little-endian ints, then little-endian uint16)."""
    path = tmp_path / "x.bin"
    write_shard(path, [1, 258, 65535])
    raw = path.read_bytes()
    head = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert head[:3].tolist() == [20240520, 1, 3] and not head[3:].any()
    assert raw[HEADER_BYTES:] == bytes([1, 0, 2, 1, 255, 255])


@pytest.mark.parametrize("tokens", [[5, 6, 7], (5, 6, 7), np.array([5, 6, 7], dtype=np.uint8),
                                    np.array([5, 6, 7], dtype=np.int32), np.array([5, 6, 7], dtype=">u2"),
                                    np.arange(10, dtype=np.uint16)[5:8], np.arange(15, dtype=np.int64)[5:11:2]])
def test_write_accepts_int_array_likes(tmp_path, tokens):
    path = tmp_path / "x.bin"
    write_shard(path, tokens)
    assert np.array_equal(load_shard(path), np.asarray(tokens).astype(np.int64))


def test_load_returns_writable_independent_array(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, [1, 2, 3])
    a = load_shard(path)
    a[0] = 9  # a private copy: changing it must not touch the file or a second load
    assert load_shard(path).tolist() == [1, 2, 3]
    assert a.astype(np.int32).tolist() == [9, 2, 3]


@pytest.mark.parametrize("tokens, match", [
    ([0, 65536], r"token id 65536 is outside \[0, 65535\]"),
    ([-1, 5], r"token id -1 is outside \[0, 65535\]"),
    (np.array([70000], dtype=np.uint32), r"token id 70000 is outside"),
    ([1.0, 2.0], r"tokens must be integers, got dtype float64"),
    (np.array([True, False]), r"tokens must be integers, got dtype bool"),
    ([[1, 2], [3, 4]], r"1-D sequence, got an array of shape \(2, 2\)"),
    ([], r"no tokens \(empty shards are not allowed\)"),
    ([2**70], r"tokens must be integers, got dtype object"),
])
def test_write_rejects_bad_tokens(tmp_path, tokens, match):
    path = tmp_path / "bad.bin"
    with pytest.raises(ShardError, match=match) as info:
        write_shard(path, tokens)
    assert str(path) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "x.bin"
    write_shard(path, [1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]

    # A write that dies half way must leave the previous file intact and no temporary file behind.
    def boom(fd):
        raise OSError("disk fell off")

    monkeypatch.setattr(shards.os, "fsync", boom)
    with pytest.raises(OSError, match="disk fell off"):
        write_shard(path, np.arange(100))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    assert load_shard(path).tolist() == [1, 2, 3]


def test_write_overwrites_existing(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.arange(50))
    write_shard(path, [4])
    assert load_shard(path).tolist() == [4]


def _corrupt_cases(tmp_path):
    good = np.arange(10, dtype="<u2").tobytes()
    swapped = int(np.array([MAGIC], dtype="<i4").byteswap()[0])
    return {
        "empty": (lambda p: p.write_bytes(b""), r"file is empty \(0 bytes\)"),
        "short_header": (lambda p: p.write_bytes(b"\x00" * 1000),
                         r"file is 1000 bytes, shorter than the 1024-byte header"),
        "bad_magic": (lambda p: _raw_shard(p, [12345, 1, 10], good),
                      r"bad magic number 12345 \(expected 20240520\)"),
        "swapped_magic": (lambda p: _raw_shard(p, [swapped, 1, 10], good),
                          rf"magic number is byte-swapped \(found {swapped}"),
        "wrong_version": (lambda p: _raw_shard(p, [MAGIC, 2, 10], good),
                          r"unsupported format version 2 \(this reader supports 1\)"),
        "zero_tokens": (lambda p: _raw_shard(p, [MAGIC, 1, 0]), r"header says 0 tokens; a shard must hold"),
        "negative_tokens": (lambda p: _raw_shard(p, [MAGIC, 1, -5]), r"header says -5 tokens"),
        "truncated": (lambda p: _raw_shard(p, [MAGIC, 1, 10], good[:-3]),
                      r"truncated: header says 10 tokens \(1044 bytes\) but the file has 1041 bytes "
                      r"\(3 bytes missing\)"),
        "trailing": (lambda p: _raw_shard(p, [MAGIC, 1, 10], good + b"\x01\x02"),
                     r"2 trailing bytes: header says 10 tokens \(1044 bytes\) but the file has 1046 bytes"),
    }


@pytest.mark.parametrize("case", ["empty", "short_header", "bad_magic", "swapped_magic", "wrong_version",
                                  "zero_tokens", "negative_tokens", "truncated", "trailing"])
@pytest.mark.parametrize("reader", ["read_header", "load_shard", "load_shard_mmap"])
def test_corrupt_file_raises_named_error(tmp_path, case, reader):
    make, match = _corrupt_cases(tmp_path)[case]
    path = tmp_path / f"{case}.bin"
    make(path)
    fn = {"read_header": read_header, "load_shard": load_shard,
          "load_shard_mmap": lambda p: load_shard(p, mmap=True)}[reader]
    with pytest.raises(ShardError, match=match) as info:
        fn(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_valid_raw_file_written_elsewhere_loads(tmp_path):
    """A file produced by another writer of the same format (e.g. the published FineWeb shards) loads."""
    tokens = np.array([50256, 15496, 995], dtype="<u2")
    path = _raw_shard(tmp_path / "ext.bin", [MAGIC, VERSION, 3], tokens.tobytes())
    assert load_shard(path).tolist() == [50256, 15496, 995]


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "nope.bin")


def test_shard_files_sorted(tmp_path):
    for i in (3, 1, 10, 2):
        write_shard(tmp_path / f"fineweb_train_{i:06d}.bin", [i])
    write_shard(tmp_path / "fineweb_val_000000.bin", [0])
    (tmp_path / "fineweb_train_dir.bin").mkdir()  # a folder matching the glob is not a shard
    files = shard_files(tmp_path / "fineweb_train_*.bin")
    assert [f.name for f in files] == [f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3, 10)]
    assert shard_files(str(tmp_path / "fineweb_val_*.bin")) == [tmp_path / "fineweb_val_000000.bin"]


def test_shard_files_missing_names_pattern_and_download_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape("'data/fineweb10B/fineweb_train_*.bin'")) as info:
        shard_files("data/fineweb10B/fineweb_train_*.bin")
    assert "python data/cached_fineweb10B.py 9" in str(info.value)
    assert str(tmp_path) in str(info.value)  # a relative pattern says what it was relative to

    pattern = str(tmp_path / "mine" / "x_*.bin")
    with pytest.raises(FileNotFoundError, match=re.escape(pattern)) as info:
        shard_files(pattern)
    assert "cached_fineweb10B" not in str(info.value)


def test_check_token_ids_returns_the_largest_id(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    write_shard(a, [5, 511, 7])
    write_shard(b, [3, 4])
    assert check_token_ids([a, b], 512) == 511
    assert check_token_ids([b], None) == 4
    with pytest.raises(ShardError, match=r"a\.bin: token id 511 at position 1 .*vocab_size 511"):
        check_token_ids([b, a], 511)
    with pytest.raises(ShardError, match=r"token id 511 at position 1 is outside GPT-2's; were these shards"):
        check_token_ids([a], 100, "GPT-2's")
