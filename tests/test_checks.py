"""kernels/_checks.py: the memory-overlap test every launcher uses to refuse aliasing arguments."""
import pytest
import torch

from kernels._checks import byte_range, check_kernel_device, overlaps


def test_byte_range_of_views():
    base = torch.empty(10, 8, dtype=torch.float32)
    p = base.data_ptr()
    assert byte_range(base) == (p, p + 320)
    assert byte_range(base[2:4]) == (p + 64, p + 128)
    assert byte_range(base.T) == (p, p + 320)
    assert byte_range(base[:, 1]) == (p + 4, p + 4 + 9 * 32 + 4)
    assert byte_range(base[:0]) == (0, 0)


def test_overlaps():
    base = torch.empty(10, 8)
    assert overlaps(base, base.T)
    assert overlaps(base[2:5], base[4:6])
    assert not overlaps(base[2:4], base[4:6])  # adjacent rows share no byte
    assert overlaps(base[:, 0], base[:, 1])  # interleaved: conservative, reported as overlapping
    assert not overlaps(base[:0], base)  # empty tensors never overlap
    assert not overlaps(base, torch.empty(10, 8))


def test_check_kernel_device(monkeypatch):
    check_kernel_device("op", torch.device("cuda", 0))  # never raises for CUDA, GPU present or not
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_kernel_device("op", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"op: tensors must be on a CUDA device .* got cpu"):
        check_kernel_device("op", torch.device("cpu"))
    with pytest.raises(ValueError, match="got meta"):
        check_kernel_device("op", torch.device("meta"))
