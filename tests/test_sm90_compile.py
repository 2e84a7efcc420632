"""Every Triton kernel compiles for an H100/H200 (sm_90a), checked on machines without a GPU.

The CPU suite runs the kernels in Triton's interpreter, which runs programs the GPU compiler rejects: a helper
called from a kernel without ``@triton.jit`` runs in the interpreter and fails to compile (seen: removing the
decorator of kernels/embedding.py's ``_round`` left test_embedding.py green and failed this test). Here
tests/sm90_compile_worker.py, in a process without TRITON_INTERPRET, calls each kernel family's launchers the way
train_gpt.py does, with the GPU's launch configurations, records the launches instead of running them, and
compiles each for target ("cuda", 90) through ptxas (Triton's wheel carries it). CPU-only: on a GPU the suite
compiles and runs every kernel for real."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _THREADS, HAS_CUDA

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["adam", "cross_entropy", "embedding", "mlp", "momentum", "normuon", "polar_express", "transpose"]


# The cross-entropy kernels compiled 16-byte specialised, as the GPU launches them on aligned tensors, with their
# SASS instruction counts (--sass): their family test reads those lines, the other families' are unspecialised.
SASS = "cross_entropy:sass"
RUN_AS = {"cross_entropy": SASS}


@pytest.fixture(scope="module")
def compiled():
    """(the worker's exit status and stderr, {family: its JSON lines}) of one worker run for every family (RUN_AS:
    the cross-entropy kernels as SASS), each compiled in one of this worker's share of the CPU cores (imports once,
    compiles in parallel)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")  # Triton's GPU default, stated
    entries = [RUN_AS.get(f, f) for f in FAMILIES]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sm90_compile_worker.py"), *entries, "--jobs",
                           str(_THREADS)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = {f: [] for f in entries}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            lines[row["family"]].append(row)
    return (proc.returncode, proc.stderr[-4000:]), lines


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the suite compiles and runs every kernel for real")
@pytest.mark.xdist_group("sm90_compile")
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_compile_for_sm90(family, compiled):
    """Each launch of the family compiles to an sm_90a cubin (the cross-entropy family's 16-byte specialised:
    RUN_AS), and every ``*_kernel`` of kernels/<family>.py is among them (a kernel no launch reaches would go
    unchecked)."""
    (code, stderr), lines = compiled
    assert code == 0, stderr
    assert lines[RUN_AS.get(family, family)], f"no output for {family}: {stderr}"
    first, *rows = lines[RUN_AS.get(family, family)]
    assert "error" not in first, first["error"]
    assert rows, "no launch recorded"
    failed = [f"{r['kernel']} {r['signature']} {r['constexprs']} {r['options']}:\n{r['error']}" for r in rows
              if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    missing = set(first["defined"]) - {r["kernel"] for r in rows}
    assert not missing, f"kernels of kernels/{family}.py that no launch reached: {sorted(missing)}"


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the suite compiles and runs every kernel for real")
@pytest.mark.xdist_group("sm90_compile")
def test_cross_entropy_row_kernels_spend_three_mufu_per_element(compiled):
    """The cross-entropy kernels' design (kernels/cross_entropy.py): three special-function operations per logit,
    2^t and the reciprocal square root of the sigmoid and the exp of the softmax, checked in the sm_90a code of the
    launches train_gpt.py makes (``--sass``: 16-byte specialised, as on the GPU): a tile loop of the row kernels
    holds 3 MUFU instructions per element of a thread's tile (BLOCK_V / (32 * num_warps) elements), plus at most
    one per tile in the forward (the rescale of the running sums). A correctly rounded division (tl.div_rn) or
    tl.sigmoid's would add a MUFU.RCP per element. The fused kernel (the gradient in the forward) holds both: its row
    loop's two full-tile loops, pass A and pass B, spend what the forward's and the backward's loops spend."""
    (code, stderr), lines = compiled
    assert code == 0, stderr
    assert lines[SASS], f"no output for {SASS}: {stderr}"
    first, *rows = lines[SASS]
    assert "error" not in first, first["error"]
    assert all(r["ok"] for r in rows), [r["error"] for r in rows if not r["ok"]]
    row_kernels = [r for r in rows if r["kernel"] in ("_ce_fwd_kernel", "_ce_bwd_kernel")]
    assert {r["kernel"] for r in row_kernels} == {"_ce_fwd_kernel", "_ce_bwd_kernel"}
    for r in row_kernels:
        per_thread = int(r["constexprs"]["BLOCK_V"]) // (32 * r["options"]["num_warps"])
        extra = 1 if r["kernel"] == "_ce_fwd_kernel" else 0
        s = r["sass"]
        assert 3 * per_thread <= s["loop_mufu"] <= 3 * per_thread + extra, (r["kernel"], r["constexprs"], s)
        assert s["loop_instructions"] > s["loop_mufu"], s
    fused = [r for r in rows if r["kernel"] == "_ce_fwd_grad_kernel"]
    assert {r["constexprs"]["E5M2"] for r in fused} == {"True", "False"}
    for r in fused:
        per_thread = int(r["constexprs"]["BLOCK_V"]) // (32 * r["options"]["num_warps"])
        inner = sorted(mufu for _, mufu in r["sass"]["inner_loops"])
        assert inner == [3 * per_thread, 3 * per_thread + 1], (r["constexprs"], r["sass"])
