"""Tests for kernels/mlp.py: the up-projection with ReLU² in its epilogue, forward and backward, and the MLP's
custom op (its gradients, and how torch.compile records it), against a float64 specification written here again:

    pre[m, n]  = sum_k x[m, k] w[n, k]
    act[m, n]  = max(pre[m, n], 0)^2
    dpre[m, n] = (sum_k g[m, k] w2[n, k]) * 2 max(pre[m, n], 0)
    mlp(x)     = act @ w_proj_t;  d x = dpre @ w_fc, d w_fc = dpre^T x, d w_proj_t = act^T dy

Tolerances (tests/tolerances.py, rule 1): the kernel's error is at most twice torch's on the same inputs plus one
unit roundoff of the terms' magnitude. For pre that magnitude is max(|x| @ |w|^T) (a dot product's rounding error
scales with its terms). act = pre^2 carries pre's error times 2|pre| (first order), so its scale is
max(2 |pre| (|x| @ |w|^T)); dpre's is max((|g| @ |w2|^T) 2 |relu(pre)|). Beyond the bound: act must equal
torch's relu(pre)^2 of the kernel's own pre bit for bit, and the persistent grid must give the same bits whatever
its size (every tile is computed the same way by whichever program takes it).

Without a GPU the kernels run in Triton's interpreter in fp32 (IEEE dots) on small shapes; bf16 and fp16 run on
the GPU (the interpreter rounds fp32 -> bf16 toward zero, not to nearest even).
"""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compilation import cpp_wrapper_options
from kernels.mlp import (CONFIGS, INTERPRETER_PROGRAMS, TUNING_CANDIDATES, linear_relu2, linear_relu2_bwd,
                         linear_relu2_bwd_ref, linear_relu2_ref, relu2_mlp, relu2_mlp_ref)
from tests.tolerances import assert_all_written, assert_matches_torch, nan_like, shifted_randn

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (bf16/fp16 tensor-core dots)")

# (M, N, K): one row; odd M with N and K not multiples of any tile; multiples of the fp32 tile (64, 64, 32); M
# spanning several tile rows with a partial last one. N and K are multiples of 8 (TMA's 16-byte rows in bf16).
CPU_SHAPES = [(1, 8, 8), (37, 72, 40), (64, 128, 64), (130, 136, 72)]
# GPU: the above, an odd M with a partial last tile in every dimension of the 128 x 256 x 64 tile, one exact
# multiple of it, and the speedrun's stage-0 micro-step (M = 16384 tokens, 3072 x 768).
GPU_SHAPES = CPU_SHAPES + [(1151, 200, 72), (256, 512, 128), (16384, 3072, 768)]
SHAPES = GPU_SHAPES if HAS_CUDA else CPU_SHAPES
LOWP = [torch.bfloat16, torch.float16]
DTYPES = [pytest.param(d, marks=gpu_only) for d in LOWP] + [torch.float32]


def spec_fwd(x, w):
    """float64 (pre, act) of the specification above."""
    pre = torch.einsum("mk,nk->mn", x.double(), w.double())
    return pre, pre.clamp(min=0) ** 2


def spec_bwd(g, w2, pre):
    return torch.einsum("mk,nk->mn", g.double(), w2.double()) * 2 * pre.double().clamp(min=0)


def inputs(M, N, K, dtype, seed=0):
    """x shifted (mean -2.3, as a normed activation is not centred), w of scale K^-1/2: pre has both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = shifted_randn(M, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, dtype)
    g = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w2 = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, dtype)
    return x, w, g, w2


def terms(a, b):
    return (a.double().abs() @ b.double().abs().T)


def check_forward(x, w, pre, act, tag):
    pre64, act64 = spec_fwd(x, w)
    pre_lp, act_lp = linear_relu2_ref(x, w)
    t = terms(x, w)
    assert_matches_torch(pre, pre64, pre_lp, name=f"pre {tag}", scale=t.max().item())
    assert_matches_torch(act, act64, act_lp, name=f"act {tag}", scale=(2 * pre64.abs() * t).max().item())
    assert torch.equal(act, torch.relu(pre).square()), f"act {tag} is not relu(pre)^2 of the kernel's pre"


def check_backward(g, w2, pre, dpre, tag):
    dpre64 = spec_bwd(g, w2, pre)
    dpre_lp = linear_relu2_bwd_ref(g, w2, pre)
    scale = (terms(g, w2) * 2 * pre.double().clamp(min=0)).max().item()
    assert_matches_torch(dpre, dpre64, dpre_lp, name=f"dpre {tag}", scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=lambda v: str(v))
def test_forward_and_backward_match_spec(M, N, K, dtype):
    if dtype == torch.float32 and M * N * K > 1 << 24:
        pytest.skip("fp32 runs IEEE dots (the tests' path): the speedrun shape is checked in bf16 and fp16")
    x, w, g, w2 = inputs(M, N, K, dtype)
    pre, act = nan_like(x.new_empty(M, N)), nan_like(x.new_empty(M, N))
    linear_relu2(x, w, out=(pre, act))
    assert_all_written(pre, "pre")
    assert_all_written(act, "act")
    check_forward(x, w, pre, act, f"{(M, N, K)} {dtype}")
    dpre = linear_relu2_bwd(g, w2, pre, out=nan_like(pre))
    assert_all_written(dpre, "dpre")
    check_backward(g, w2, pre, dpre, f"{(M, N, K)} {dtype}")


@pytest.mark.parametrize("layout", ["row_slice", "transposed", "column_step", "unaligned_rows", "bank_row"])
def test_strided_operands(layout):
    """Operands as views: a slice of wider rows (16-byte aligned: read in place); a transposed view, every other
    column of an aligned buffer and rows at an odd offset (not TMA layouts: copied); a matrix of a parameter bank
    (the trainer's W_fc)."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = 130, 136, 72
    x, w, g, w2 = inputs(M, N, K, dtype, seed=1)

    def view(t):
        if layout == "row_slice":
            buf = torch.zeros(t.shape[0], t.shape[1] + 8, dtype=dtype, device=DEVICE)
            buf[:, :t.shape[1]] = t
            return buf[:, :t.shape[1]]
        if layout == "transposed":
            return t.T.contiguous().T
        if layout == "column_step":
            buf = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=dtype, device=DEVICE)
            buf[:, ::2] = t
            return buf[:, ::2]
        if layout == "unaligned_rows":
            buf = torch.zeros(t.shape[0], t.shape[1] + 1, dtype=dtype, device=DEVICE)
            buf[:, 1:] = t
            return buf[:, 1:]
        bank = torch.stack([torch.zeros_like(t), t, torch.zeros_like(t)])
        return bank.unbind(0)[1]

    pre, act = linear_relu2(view(x), view(w))
    ref_pre, ref_act = linear_relu2(x, w)
    assert torch.equal(pre, ref_pre) and torch.equal(act, ref_act), f"{layout}: other bits than contiguous inputs"
    dpre = linear_relu2_bwd(view(g), view(w2), view(pre))
    assert torch.equal(dpre, linear_relu2_bwd(g, w2, pre)), f"{layout}: dpre differs from contiguous inputs"


@pytest.mark.parametrize("num_programs", [1, 2, 5, 10_000])
def test_persistent_grid_size_gives_same_bits(num_programs):
    """1 program takes every tile, 10_000 more programs than tiles (clamped to one tile each)."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = (1151, 600, 72) if HAS_CUDA else (130, 136, 72)
    x, w, g, w2 = inputs(M, N, K, dtype, seed=2)
    pre, act = linear_relu2(x, w)
    p, a = linear_relu2(x, w, num_programs=num_programs, out=(nan_like(pre), nan_like(act)))
    assert torch.equal(p, pre) and torch.equal(a, act)
    dpre = linear_relu2_bwd(g, w2, pre)
    assert torch.equal(linear_relu2_bwd(g, w2, pre, num_programs=num_programs, out=nan_like(dpre)), dpre)


def test_traced_grid_is_the_program_count_whatever_the_rows(monkeypatch):
    """Traced by torch.compile (train_gpt.py --dynamic-tokens: M a dynamic size), the persistent grid is the
    program count, not min(programs, tiles): the kernel's NUM_PROGRAMS is a compile-time constant, which a tile
    count from a symbolic M would tie to M (a recompile per M). dynamo's eager backend over the launcher's grid
    at M = 64 (2 tiles of 64 rows, fewer than the 4 programs) and 512: 4 programs at both, one graph (the kernels
    themselves cannot be traced on the CPU); eagerly, at most one program per tile. The extra programs find no
    tile: a grid of more programs than tiles gives the clamped grid's bits (the test lifts the clamp). Operands that
    are fake tensors (AOT autograd tracing the op's implementation outside dynamo) get the program count too."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    import kernels.mlp as mlp
    from compilation import unique_graphs

    def grid(x):
        return x * mlp._programs(x, triton.cdiv(x.shape[0], 64) * 2, 4)

    torch._dynamo.reset()
    graphs = unique_graphs()
    try:
        f = torch.compile(grid, backend="eager", fullgraph=True, dynamic=False)
        for M in (64, 512):
            x = torch.ones(M, 8)
            torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(f(x), 4 * x), f"M={M}: the traced grid is not the 4 programs"
        frames = unique_graphs() - graphs
    finally:
        torch._dynamo.reset()
    assert frames == 1, f"{frames} graphs for two M"
    with FakeTensorMode():  # AOT autograd's trace of the op's implementation, where dynamo is not tracing
        assert [mlp._programs(torch.empty(64, 8), t, 4) for t in (2, 16)] == [4, 4], "fake operands: not the 4"
    assert [mlp._programs(torch.empty(64, 8), t, 4) for t in (2, 16)] == [2, 4], "eagerly: one program per tile"
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w, g, w2 = inputs(130, 136, 72, dtype, seed=3)  # 3 x 3 tiles of 64 x 64 (fp32), 2 x 1 of 128 x 256 (bf16)
    pre, act = linear_relu2(x, w)
    dpre = linear_relu2_bwd(g, w2, pre)
    monkeypatch.setattr(mlp, "_programs", lambda a, tiles, num_programs: tiles + 3)
    p, a = linear_relu2(x, w, out=(nan_like(pre), nan_like(act)))
    assert torch.equal(p, pre) and torch.equal(a, act)
    assert torch.equal(linear_relu2_bwd(g, w2, pre, out=nan_like(dpre)), dpre)


def test_empty_and_zero_inner_dims():
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w = torch.ones(0, 16, dtype=dtype, device=DEVICE), torch.ones(8, 16, dtype=dtype, device=DEVICE)
    pre, act = linear_relu2(x, w)
    assert pre.shape == (0, 8) and act.shape == (0, 8)
    x0, w0 = torch.ones(5, 0, dtype=dtype, device=DEVICE), torch.ones(8, 0, dtype=dtype, device=DEVICE)
    pre, act = linear_relu2(x0, w0, out=(nan_like(torch.empty(5, 8, dtype=dtype, device=DEVICE)),
                                         nan_like(torch.empty(5, 8, dtype=dtype, device=DEVICE))))
    assert (pre == 0).all() and (act == 0).all()
    assert (linear_relu2_bwd(x0, w0, torch.ones(5, 8, dtype=dtype, device=DEVICE)) == 0).all()


@pytest.mark.parametrize("call,message", [
    (lambda t: linear_relu2(t(4, 16)[0], t(8, 16)), "2-D"),
    (lambda t: linear_relu2(t(4, 16), t(8, 24)), "inner dims differ"),
    (lambda t: linear_relu2(t(4, 16), t(8, 16).double()), "float64"),
    (lambda t: linear_relu2(t(4, 16).int(), t(8, 16).int()), "dtype"),
    (lambda t: linear_relu2(t(4, 16), t(7, 16)), "multiple of 16 bytes"),
    (lambda t: linear_relu2(t(4, 15), t(8, 15)), "multiple of 16 bytes"),
    (lambda t: linear_relu2(t(4, 16), t(8, 16), out=(t(4, 8), t(8, 4))), "out act"),
    (lambda t: linear_relu2_bwd(t(4, 16), t(8, 16), t(4, 9)), r"pre must be \(4, 8\)"),
    (lambda t: linear_relu2_bwd(t(4, 16), t(8, 16), t(4, 8), out=t(8, 4).T), "out dpre"),
])
def test_bad_input_is_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(lambda *s: torch.zeros(*s, device=DEVICE))


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="linear_relu2: tensors must be on a CUDA device"):
        linear_relu2(torch.zeros(4, 16), torch.zeros(8, 16))


@pytest.mark.parametrize("direction,config", [(d, c) for d in ("fwd", "bwd") for c in sorted(
    set(TUNING_CANDIDATES[d]) | {v for (k, _), v in CONFIGS.items() if k == d})], ids=str)
def test_every_config_matches_spec(direction, config):
    """Every tile the launcher or the benchmark's tuning pass may use in that direction (on the CPU in fp32: the
    interpreter runs any tile), on a shape with partial tiles in M, N and K."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = 300, 264, 200
    x, w, g, w2 = inputs(M, N, K, dtype, seed=4)
    out = (nan_like(x.new_empty(M, N)), nan_like(x.new_empty(M, N)))
    if direction == "fwd":
        pre, act = linear_relu2(x, w, config=config, out=out)
        check_forward(x, w, pre, act, f"config {config}")
    else:
        pre, _ = linear_relu2(x, w)
        check_backward(g, w2, pre, linear_relu2_bwd(g, w2, pre, config=config, out=out[0]), f"config {config}")


def mlp_grads(fn, x, w_fc, w_proj_t, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_fc, w_proj_t)]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dy)]


def spec_mlp(x, w_fc, w_proj_t):
    pre = torch.einsum("mk,nk->mn", x, w_fc)
    return torch.einsum("mn,nc->mc", pre.clamp(min=0) ** 2, w_proj_t)


@pytest.mark.parametrize("compiled", [pytest.param(True, marks=gpu_only), False])
def test_relu2_mlp_forward_and_gradients(compiled):
    """relu2_mlp's output and its three gradients against the float64 spec (autograd of spec_mlp) and torch's
    composite in the same dtype; compiled: inside torch.compile(fullgraph=True), as in the trainer."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, C, H = (1151, 256, 1024) if HAS_CUDA else (37, 24, 72)
    gen = torch.Generator().manual_seed(3)
    x = shifted_randn(M, C, generator=gen).to(DEVICE, dtype)
    w_fc = (torch.randn(H, C, generator=gen) * C ** -0.5).to(DEVICE, dtype)
    w_proj_t = (torch.randn(H, C, generator=gen) * H ** -0.5).to(DEVICE, dtype)
    dy = torch.randn(M, C, generator=gen).to(DEVICE, dtype)
    fn = torch.compile(relu2_mlp, fullgraph=True, dynamic=False) if compiled else relu2_mlp
    got = mlp_grads(fn, x, w_fc, w_proj_t, dy)
    ref64 = mlp_grads(spec_mlp, x.double(), w_fc.double(), w_proj_t.double(), dy.double())
    ref_lp = mlp_grads(relu2_mlp_ref, x, w_fc, w_proj_t, dy)
    for name, a, e, l in zip(["out", "dx", "dw_fc", "dw_proj_t"], got, ref64, ref_lp):
        assert a.dtype == dtype and a.shape == l.shape
        assert_matches_torch(a, e, l, name=f"relu2_mlp {name} compiled={compiled}")


def test_relu2_mlp_is_a_cacheable_op_of_dynamos_graph():
    """In the compiled region relu2_mlp is one custom op, an OpOverload, not an autograd.Function, which dynamo
    records as the autograd_function_apply higher-order op, for which AOT autograd's cache passes over the whole
    graph (the training step's AOT autograd then reruns at every start). The backend inspects dynamo's graph: the
    op is there, no autograd_function_apply, and AOT autograd's own cacheability check (private: run where it
    imports) passes; then it runs the graph as it is (the op's eager launches). The op's last argument is the hash of
    kernels/mlp.py, a constant of the graph, so that an edit of the launchers' Python, which the kernels' source in
    the key does not show, changes the key."""
    graphs = []

    def inspect_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w_fc, _, w_proj_t = inputs(37, 72, 24, dtype, seed=5)
    leaves = [t.requires_grad_() for t in (x, w_fc, w_proj_t)]
    torch._dynamo.reset()
    try:
        out = torch.compile(relu2_mlp, backend=inspect_graph, fullgraph=True, dynamic=False)(*leaves)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, relu2_mlp(*leaves)), "dynamo's graph, run as it is, is not the eager call"
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    applies = [t for t in targets if isinstance(t, torch._ops.HigherOrderOperator) and "autograd_function" in t.name()]
    assert not applies and torch.ops.speedrun.relu2_mlp.default in targets, f"dynamo's graph calls {targets}"
    # the op's last argument, a constant of the graph (so of AOT autograd's key): 56 bits of kernels/mlp.py's sha256
    source = (Path(__file__).resolve().parents[1] / "kernels" / "mlp.py").read_bytes()
    (call,) = [n for n in gm.graph.nodes if n.target == torch.ops.speedrun.relu2_mlp.default]
    assert call.args[-1] == int(hashlib.sha256(source).hexdigest()[:14], 16), f"the op's arguments {call.args}"
    try:
        from torch._functorch._aot_autograd.autograd_cache import check_cacheable
    except ImportError:
        return
    with torch._inductor.config.patch(fx_graph_cache=True):  # the check asks for the FX graph cache (on by default)
        check_cacheable(gm)


def test_aot_autograd_cache_key_sees_both_kernels():
    """AOT autograd's cache key holds the source of the Triton kernels torch finds in a triton_op that dynamo's graph
    calls (torch reads the op's implementation and the functions it calls for wrap_triton(kernel)); the graph calls
    speedrun::relu2_mlp only, so both kernels must be found there: editing either (or a helper they call) then
    misses the cache. The launcher's Python is in no key (kernels/mlp.py's docstring). Run where the kernels are
    compiled ones (TRITON_INTERPRET=0: torch finds no interpreted kernel) and torch has the lookup (private)."""
    code = """
import torch
try:
    from torch._library.triton import get_triton_kernels_for_op
except ImportError:
    print("no lookup")
    raise SystemExit
import kernels.mlp
print(sorted(k.__name__ for k in get_triton_kernels_for_op("speedrun::relu2_mlp")))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    if run.stdout.strip() == "no lookup":
        pytest.skip("this torch has no torch._library.triton.get_triton_kernels_for_op")
    assert run.stdout.strip() == "['_linear_relu2_bwd_kernel', '_linear_relu2_fwd_kernel']", run.stdout


def test_aot_autograd_traces_the_op_into_both_kernel_launches():
    """AOT autograd traces the op's implementation and its backward into its joint graph: two user-defined Triton
    kernel launches (the forward's and the backward's), no speedrun op (which inductor would call back into Python
    for), each on the persistent grid of the program count (here the CPU's INTERPRETER_PROGRAMS, over more tiles).
    On the CPU in a process with compiled kernels (TRITON_INTERPRET=0: torch cannot trace interpreted ones), traced
    over fake tensors and never launched; the device check is lifted for that. torch cannot analyse the kernels
    without a GPU driver there (a logged warning) and then takes every argument for mutated: copies that the GPU's
    graphs do not have."""
    code = """
import torch
import kernels.mlp as mlp
from functorch.compile import aot_function, make_boxed_func
mlp.check_kernel_device = lambda name, device: None
joint = []
class Traced(Exception):
    pass
def partition(graph, inputs, **kwargs):
    joint.append(graph)
    raise Traced
args = [torch.randn(s, requires_grad=True) for s in ((256, 128), (512, 128), (512, 128))]
try:
    aot_function(mlp.relu2_mlp, fw_compiler=make_boxed_func, partition_fn=partition)(*args)
except Traced:
    pass
for node in joint[0].graph.nodes:
    if node.op == "call_function" and ("speedrun" in str(node.target) or "triton" in str(node.target)):
        print(node.target, node.kwargs.get("grid"))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    grid = [(INTERPRETER_PROGRAMS, 1, 1)]
    assert run.stdout.split("\n")[:-1] == [f"triton_kernel_wrapper_functional {grid}"] * 2, run.stdout


@gpu_only
def test_relu2_mlp_kernels_trace_into_the_compiled_graph():
    """Under torch.compile both kernel launches (forward and backward) are nodes of the graphs inductor is given
    (user-defined Triton kernels: AOT autograd traces the op speedrun::relu2_mlp of dynamo's graph and its
    backward), not calls into Python: an opaque op would cost the trainer's C++ launcher a trip through Python per
    layer and micro-step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    import triton
    import kernels.mlp as mlp

    def record(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            # This backend runs AOT autograd's graphs as they are: torch launches the kernels itself, through
            # Triton's allocator for their descriptors' scratch (inductor brings its own), which is per thread and
            # must be set where the graph runs: the backward runs in autograd's device thread (on one H100 it had
            # none: "no allocator was set").
            triton.set_allocator(mlp._scratch)
            return gm(*args)
        return make_boxed_func(run)

    torch._dynamo.reset()
    x, w_fc, _, w_proj_t = inputs(256, 512, 128, torch.bfloat16, seed=4)
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    fn = torch.compile(relu2_mlp, fullgraph=True, dynamic=False, backend=backend)
    fn(x.requires_grad_(), w_fc, w_proj_t).float().sum().backward()
    torch._dynamo.reset()
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    launches = [t for t in targets if "triton_kernel_wrapper" in t]
    opaque = [t for t in targets if "speedrun" in t or "linear_relu2" in t]
    assert len(graphs) == 2 and len(launches) == 2 and not opaque, \
        f"{len(graphs)} graphs, kernel launches {launches}, opaque ops {opaque} in {targets}"


@gpu_only
@pytest.mark.parametrize("M, dtype", [(256, torch.bfloat16), (1151, torch.float16)])
def test_relu2_mlp_under_the_cpp_wrapper_is_the_eager_launch(M, dtype):
    """Compiled as the trainer compiles its training step (inductor's C++ launcher), relu2_mlp's output and three
    gradients are bit for bit those of the eager launches: the backward graph runs the backward kernel (torch
    2.11 once gave it the forward's cubin), and each launch gets global scratch for all its programs (its
    TMA descriptors: torch 2.11's C++ wrapper allocates one program's worth unless told otherwise).
    Compiled with inductor's caches off: the scratch size is written into the C++ code at generation time, which
    the cache key does not see, so a cached graph would test whichever process generated it (on one H200 a
    mutated copy run beside the suite failed the suite's copy of this test through the shared cache)."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    x, w_fc, dy, w_proj_t = inputs(M, 512, 256, dtype, seed=6)
    fn = torch.compile(relu2_mlp, fullgraph=True, dynamic=False, options=cpp_wrapper_options())  # --cpp-wrapper's
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(lambda: mlp_grads(fn, x, w_fc, w_proj_t, dy))
    eager = mlp_grads(relu2_mlp, x, w_fc, w_proj_t, dy)
    for name, a, e in zip(["out", "dx", "dw_fc", "dw_proj_t"], got, eager):
        assert torch.equal(a, e), f"{name}: the C++ wrapper's launch differs from eager (max {(a - e).abs().max()})"
    code = "\n".join(code)
    assert "cpp_wrapper_src" in code and "_linear_relu2_bwd_kernel" in code, "no C++ wrapper, or no backward launch"
    programs = torch.cuda.get_device_properties(DEVICE).multi_processor_count  # traced: the SM count (_programs)
    sizes = re.findall(r"int64_t global_scratch\w*_size\[\] = \{([^}]*)\}", code)
    assert len(sizes) >= 2, f"no global scratch allocated for the two launches: {sizes}"
    for size in sizes:
        assert "grid_0" in size or (int(size) % programs == 0 and int(size) >= 4 * 128 * programs), \
            f"global scratch of {size} bytes for {programs} programs of 4 TMA descriptors"


def test_cpp_wrapper_scratch_is_sized_for_every_program(monkeypatch):
    """Where inductor's C++ wrapper allocates a kernel's global scratch once (not times its grid), the parameters
    it records for the two MLP kernels carry NUM_PROGRAMS times Triton's per-program size; other kernels' are
    untouched, and a record without NUM_PROGRAMS is an error, not a short buffer."""
    import kernels.mlp as mlp
    from torch._inductor.codecache import CudaKernelParamCache
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
    recorded = {}
    monkeypatch.setattr(CudaKernelParamCache, "set",
                        classmethod(lambda cls, key, params: recorded.update({key: params})))
    monkeypatch.setattr(CudaKernelParamCache, "_mlp_scratch_per_program", False, raising=False)

    def one_program_scratch(self, idx, workspace, prefix=None):  # torch 2.11's: the size, not times the grid
        return [f"int64_t scratch_{idx}_size[] = {{{workspace.size}}};"], f"scratch_{idx}"

    monkeypatch.setattr(CUDADeviceOpOverrides, "cpp_scratch", one_program_scratch)
    assert mlp.scratch_per_program_in_cpp_wrapper()
    assert not mlp.scratch_per_program_in_cpp_wrapper(), "installed twice"
    meta = {"constants": {"NUM_PROGRAMS": 132}}
    CudaKernelParamCache.set("_linear_relu2_fwd_kernel_0", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("_linear_relu2_bwd_kernel_3", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("triton_poi_fused_add_0", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("_linear_relu2_fwd_kernel_1", {"global_scratch": None, "triton_meta": {}})
    assert {k: v["global_scratch"] for k, v in recorded.items()} == {
        "_linear_relu2_fwd_kernel_0": 512 * 132, "_linear_relu2_bwd_kernel_3": 512 * 132,
        "triton_poi_fused_add_0": 512, "_linear_relu2_fwd_kernel_1": None}
    with pytest.raises(RuntimeError, match="no NUM_PROGRAMS for _linear_relu2_bwd_kernel_0"):
        CudaKernelParamCache.set("_linear_relu2_bwd_kernel_0", {"global_scratch": 512, "triton_meta": {}})
