"""Facts about the machine and the code being measured, shared by the run's log (``run_log.py``), the benchmark
driver (``benchmarks/__main__.py``), the trainer and the kernels' launchers.

``CEILINGS``: per GPU, the memory bandwidth (bytes/s, read + write counted) and dense bf16 matmul rate
(FLOP/s) measured with a device-to-device copy and a large bf16 matmul, not the datasheet peaks. The
benchmark's roofline column and the log's MFU line (``run_log.py``) both divide by these figures, so the two
agree.

``git_sha()``: the commit that ran, for the log's header (``run_log.py``) and benchmark CSVs.

``keep_freed_memory()``: the host allocator setting of the trainer's CPU runs (``train_gpt.py``).

``sm_count(device, default)``: the streaming multiprocessors of a CUDA device, the size the persistent and
wave-counting launchers (kernels/polar_express.py, kernels/mlp.py) plan for.
"""
import ctypes
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# GPU name substring -> (memory bandwidth in bytes/s counting read + write, dense bf16 matmul FLOP/s).
CEILINGS = {
    "H200": (4.3e12, 790e12),
    "H100": (3.0e12, 800e12),
}


def ceilings_for(gpu_name, fallback=None):
    """(bandwidth, FLOP/s) of the first CEILINGS key found in ``gpu_name``; ``fallback`` when none is."""
    for key, value in CEILINGS.items():
        if key in gpu_name:
            return value
    return fallback


def git_sha():
    """The commit that ran, followed by " (+ uncommitted changes)" where tracked files differ from it (then only the
    log's source dump says what ran; so too where a copy of the tree carries another commit's .git); GIT_SHA in the
    environment wins (copies of the tree without .git, e.g. GPU hosts)."""
    if os.environ.get("GIT_SHA"):
        return os.environ["GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO, capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" (+ uncommitted changes)" if changed == 1 else "")


def keep_freed_memory():
    """CPU runs: make glibc's malloc keep freed memory for reuse instead of returning it to the system. The model
    allocates and frees tensors of tens of MB per micro-step (logits over 50304 columns); by default glibc maps
    each afresh (mmap above 32 MB, trim after free) and every page faults again (the system time this costs:
    notes/measurements.md). No effect where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: serve large blocks from the heap as well
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
    except (OSError, AttributeError):
        pass


def sm_count(device, default):
    """Number of SMs of ``device`` when it is a CUDA device, else ``default`` (Triton's interpreter on the CPU).
    Not cached here: torch caches each device's properties itself, and torch.compile traces this function (the MLP
    launcher inside the compiled step), where a functools cache only earns a warning from dynamo and a dict read
    would be guarded, so that filling it would recompile the step."""
    if device.type != "cuda":
        return default
    import torch
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
