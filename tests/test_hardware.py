"""Tests of kernels/hardware.py: the GPU ceilings lookup (the benchmarks' roofline and the trainer's MFU line),
git_sha (the environment wins; a checkout's HEAD, marked when tracked files differ; outside one "unknown"), the CPU
runs' malloc setting and sm_count traced by torch.compile without a warning."""
import collections
import subprocess
import warnings

import torch

from kernels import hardware


def test_ceilings_for_matches_a_substring_of_the_gpu_name():
    assert hardware.ceilings_for("NVIDIA H200") == hardware.CEILINGS["H200"]
    assert hardware.ceilings_for("NVIDIA H100 80GB HBM3") == hardware.CEILINGS["H100"]
    assert hardware.ceilings_for("NVIDIA A100-SXM4-80GB") is None
    assert hardware.ceilings_for("", fallback=(1.0, 2.0)) == (1.0, 2.0)
    for bandwidth, flops in hardware.CEILINGS.values():  # bytes/s and FLOP/s: measured, below the datasheets
        assert 1e12 < bandwidth < 1e13 and 1e14 < flops < 1e15


def test_git_sha(monkeypatch, tmp_path):
    """GIT_SHA wins; in a checkout the HEAD commit, marked " (+ uncommitted changes)" once a tracked file differs
    from it (an untracked file is not the code that ran: not marked); without .git "unknown"."""
    monkeypatch.setenv("GIT_SHA", "abc123")
    assert hardware.git_sha() == "abc123"
    monkeypatch.delenv("GIT_SHA")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (repo / "train_gpt.py").write_text("print(1)\n")
    for cmd in (["init", "-q"], ["add", "train_gpt.py"], ["commit", "-q", "-m", "one"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(hardware, "REPO", repo)
    (repo / "notes.txt").write_text("untracked\n")
    assert hardware.git_sha() == head
    (repo / "train_gpt.py").write_text("print(2)\n")
    assert hardware.git_sha() == head + " (+ uncommitted changes)"
    monkeypatch.setattr(hardware, "REPO", tmp_path / "copy")  # a copy of the tree without .git
    (tmp_path / "copy").mkdir()
    assert hardware.git_sha() == "unknown"


def test_keep_freed_memory_is_safe_to_call_twice():
    """mallopt where glibc is the allocator, nothing elsewhere: never an error, whatever the platform."""
    assert hardware.keep_freed_memory() is None
    assert hardware.keep_freed_memory() is None


def test_sm_count_traces_without_a_dynamo_warning(monkeypatch):
    """The compiled training step traces sm_count (the fused MLP's launcher plans its programs with it): dynamo
    must trace it without a warning (a functools cache there earns "Dynamo detected a call to a
    `functools.lru_cache`-wrapped function ... Silent incorrectness is only a *potential* risk", twice per GPU run),
    and the compiled value is the device's, one graph for every call (no cache whose filling recompiles). CPU:
    torch.compile's eager backend, the CUDA query replaced by a device of 132 SMs (a named tuple: what dynamo can
    hold as the query's constant result); on a GPU the real query (dynamo's own CUDA checks read more properties
    than the stand-in has)."""
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        sms = 132
        props = collections.namedtuple("Properties", "multi_processor_count")(sms)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def scaled(x):
        return x * hardware.sm_count(torch.device("cuda", 0), 4) + hardware.sm_count(torch.device("cuda"), 4)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(scaled, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(torch.ones(2))
        again = compiled(torch.ones(2))  # the same graph: nothing the first call filled is guarded (a dict cache is)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert [str(w.message) for w in caught] == []
    assert out.tolist() == again.tolist() == [2.0 * sms] * 2 and graphs == 1
    assert hardware.sm_count(torch.device("cpu"), 4) == 4
