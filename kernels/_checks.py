"""Input checks shared by the kernel launchers (no kernels here).

``overlaps(a, b)``: whether two tensors' memory ranges intersect. A launcher that writes ``b`` while reading ``a``
must refuse overlapping arguments: Triton programs run in no defined order, so an in-place transpose or an
``out`` aliasing an input would read values already overwritten. The test is conservative: it compares the
byte ranges the tensors span (``data_ptr()`` already includes the storage offset; PyTorch strides are never
negative, so the last element sits at ``sum((size - 1) * stride)``), so two interleaved views that share no
element are still reported as overlapping.

``check_kernel_device(name, device)``: Triton kernels run on a CUDA device, or on the CPU only inside Triton's
interpreter (``interpreting()``: ``TRITON_INTERPRET=1``, which tests/conftest.py sets on machines without a GPU).
"""
import os


def byte_range(t):
    """[first, last) bytes spanned by ``t``; (0, 0) for an empty tensor."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (start, start + (last + 1) * t.element_size())


def overlaps(a, b):
    """True when ``a`` and ``b`` are on one device and their byte ranges intersect (empty tensors never do)."""
    if a.device != b.device:
        return False
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


def interpreting():
    """Whether Triton's kernels run in its interpreter (``TRITON_INTERPRET=1``) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_kernel_device(name, device):
    """Raise a ValueError naming ``name`` unless ``device`` can run Triton kernels (CUDA, or CPU + interpreter)."""
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    raise ValueError(f"{name}: tensors must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1), got {device}")
