"""The MLP's up-projection and ReLU² in one matmul, forward and backward.

The speedrun's MLP (``train_gpt.mlp_sublayer``) is ``out = relu(x W_fc^T)^2 W_proj^T`` with x = norm(lane) (M, C),
W_fc (H, C) and W_proj^T stored as ``w_proj_t`` (H, C); C = 768, H = 3072 and M = 16384 / 32768 / 49152 tokens per
micro-step in the three batch stages. Left to torch, the ReLU² is an elementwise pass of its own in each
direction: the forward reads ``pre`` and writes ``act`` (2 x 100 MB at M = 16384), the backward reads
``d act`` and ``pre`` and writes ``d pre`` (3 x 100 MB). Here they move into the epilogue of the matmul that
produces ``pre`` (forward) or ``d act`` (backward), while the tile is still in registers:

    forward   pre = x @ w^T                    (M, N) = (M, K) @ (N, K)^T, fp32 accumulation
              act = relu(pre)^2                 computed from the rounded pre, as torch computes it
    backward  dpre = (g @ w2^T) * 2 relu(pre)   g = d out (M, K), w2 = w_proj_t (N, K), pre (M, N) saved

so the forward writes pre and act (pre is what the backward's ReLU' reads, act is what W_proj's gradient and the
next matmul read), and the backward never writes ``d act``. Rounding: ``pre`` and ``act`` are rounded once each
to the inputs' dtype, ``act`` bitwise ``relu(pre)^2`` of the stored ``pre`` (the same bits as torch's eager and
compiled ``F.relu(pre).square()``); ``dpre`` is rounded once from the fp32 product of the accumulator and
``2 relu(pre)`` (torch rounds ``d act`` to bf16 first: one rounding fewer here).

Act-only mode (record #87's idea): ``linear_relu2_act``, ``linear_relu2_bwd_act``, ``relu2_mlp(act_only=True)``:

    forward   act = relu(x @ w^T)^2            (M, N), the same bits as above; pre is neither written nor allocated
    backward  dpre = (g @ w2^T) * 2 r,  r = rnd(sqrt(act))   act (M, N) saved instead of pre; sqrt in fp32 (the
                                                             hardware's approximate one), rounded to act's dtype

For r a value of the dtype (the stored relu(pre)) and act = rnd(r^2) a normal number, rnd(sqrt(act)) = r exactly
(round to nearest in binary floating point: a square root undoes a rounded square; tests/test_mlp.py checks every
bf16 and fp16 value), and so does the rounding of any fp32 value within 2^-20 of sqrt(act), relative: sqrt(act)
lies at least 2^-10.1 (bf16) or 2^-13.2 (fp16) from a rounding boundary. So the approximate fp32 square root
(``tl.sqrt``, within a few fp32 ulps) serves as well as IEEE's ``tl.sqrt_rn``, an instruction sequence per element
in the epilogue: the ReLU' factor, hence dpre, has the default's bits. fp32 operands (the tests' path) keep
``tl.sqrt_rn``: sqrt_rn(fl(r^2)) = r in fp32, where no rounding to a shorter dtype absorbs an approximation's
error. Where act is below the dtype's smallest normal (bf16: relu(pre) < 2^-63, in practice never; fp16:
relu(pre) < 2^-7) act's error is absolute, up to half a subnormal spacing, and so is the factor's
(tests/test_mlp.py derives the bound). What it saves per call: the forward's (M, N) write of pre, and the backward
reads act where it read pre (the same bytes): at M = 16384 and N = 3072, 100 MB of the forward's 304 MB (x, w,
pre, act). The caller saves act for W_proj's gradient anyway, so
the backward's memory holds one (M, N) tensor per layer instead of two.

Dtype policy: bf16 (training) and fp16 multiply on tensor cores with fp32 accumulation; fp32 inputs use exact
IEEE fp32 dots (``input_precision="ieee"``, no TF32): that path is for the tests (the Triton interpreter on the
CPU), not for speed. Outputs have the inputs' dtype.

Kernels: ``_linear_relu2_fwd_kernel`` and ``_linear_relu2_bwd_kernel``, one body (``_linear_relu2_tiles``), each
with the act-only mode as the constexpr ``ACT_ONLY`` (the forward then writes act to its C operand and makes no
store to AUX, which the launcher passes as C again; the backward reads act from AUX), persistent: ``num_programs``
programs (the SM count on a GPU) walk the (BLOCK_M, BLOCK_N) output tiles in row-major order, so programs running
together share A's row panel and all of B (3072 x 768 bf16 is 4.7 MB, resident in L2). Operands and outputs move
through TMA tensor descriptors that each program makes on the device (``tl.make_tensor_descriptor``, 128 bytes of
global scratch memory per descriptor and program: inductor's workspace in compiled graphs; otherwise Triton's
allocator, which the launchers set in eager calls and a caller running a traced graph through another backend must
set, outside the compiled region, e.g. ``triton.set_allocator(kernels.mlp._scratch)``): loads past the edges read
zeros and stores past them are dropped, so M, N and K need not be multiples of the tile. The epilogue works on the
tile's two halves (BLOCK_N / 2 columns each) in turn, which halves the registers and shared memory the stores hold.
TMA asks for a 16-byte aligned base and row stride and a contiguous last dim: the launchers copy an operand that is
not (never the case in the trainer, where every operand is a fresh activation or a row of a parameter bank).

Where train_gpt.py uses it: ``relu2_mlp`` (at the end of this module) is the MLP of every layer on CUDA with bf16/fp16
weights when ``--fused-mlp`` is on (the default): the custom op ``speedrun::relu2_mlp`` (``torch.library.triton_op``),
whose implementation calls ``linear_relu2`` then ``act @ w_proj_t`` (cuBLAS) and returns pre and act beside the output
for its backward (``register_autograd``): the op ``speedrun::linear_relu2_bwd`` (``linear_relu2_bwd``), then the weight
and input gradients (cuBLAS). With ``--mlp-act-only`` (opt-in, off by default) the act-only mode's ops
``speedrun::relu2_mlp_act_only`` and ``speedrun::linear_relu2_bwd_act`` (``linear_relu2_act``, ``linear_relu2_bwd_act``)
take their places. The ops are registered at first use (``register_ops``: registering imports torch's compiler, which
``train_gpt.py --help`` need not pay). Ops, not an autograd.Function: dynamo records an autograd.Function as the
``autograd_function_apply`` higher-order op, for which AOT autograd's cache passes over the whole graph; an op is one
node it caches. Inside the trainer's compiled region AOT autograd traces the ops' implementations, launchers included
(every check they make there is on shapes, dtypes and strides; ``_traced`` tells a traced operand: fake tensors), where
``wrap_triton`` records each launch, so the kernels are user-defined Triton kernels of inductor's graph, launched from
inductor's own code (from C++ under ``--cpp-wrapper``) like the kernels it generates: no call back into Python per
launch (176 launches per step at stage 0: 11 layers, 8 micro-steps, two directions). What AOT autograd's cache key holds
of them: the source of the kernels torch finds in the op that dynamo's graph calls (both, by reading ``wrap_triton``'s
arguments in ``_launch``) and of the @triton.jit functions they call, not the Python of the launchers, the ops or the
backward (tiles, grid, the matmuls around the kernels); so the ops take ``SOURCE_KEY``, the hash of this file, as an
argument that dynamo writes into its graph: an edit anywhere here is a new key, and a cached graph never runs old
launches. Torch 2.11's C++ wrapper needs three things of the kernels: plain tensor and integer arguments (a graph whose
user kernel takes host-made ``TensorDescriptor``s does not compile); two functions, since its launcher keys the compiled
kernel by the function's name (one function for both directions would run the forward's cubin in the backward; the
act-only mode is a constexpr of each, since a run's graphs use one mode); and global scratch for every program, which
``scratch_per_program_in_cpp_wrapper`` arranges (its C++ code allocates one program's 512 bytes for the whole grid).
``--cpp-wrapper``'s options add ``triton.store_cubin``, without which a backward graph finds no compiled kernel to load.
The measured speed of these kernels against cuBLAS + a fused pointwise kernel is in notes/measurements.md
(``python -m benchmarks --only mlp``).
"""
import hashlib
import inspect
from pathlib import Path
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from kernels._checks import check_kernel_device, interpreting
from kernels.hardware import sm_count

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# References (pure PyTorch; float64 inputs give the tests' reference)
# ---------------------------------------------------------------------------------------------------------
def linear_relu2_ref(x, w):
    """(pre, act) = (x @ w^T, relu(pre)^2) in x's dtype, as the speedrun's composite MLP computes them."""
    pre = x @ w.T
    return pre, torch.relu(pre).square()


def linear_relu2_bwd_ref(g, w2, pre):
    """dpre = (g @ w2^T) * 2 relu(pre): the gradient of relu(pre)^2 @ w2 with respect to pre, for d out = g."""
    return (g @ w2.T) * (2 * torch.relu(pre))


def linear_relu2_act_ref(x, w):
    """act = relu(x @ w^T)^2 in x's dtype (the act-only forward: pre is not kept)."""
    return linear_relu2_ref(x, w)[1]


def linear_relu2_bwd_act_ref(g, w2, act):
    """dpre = (g @ w2^T) * 2 sqrt(act) rounded to act's dtype: linear_relu2_bwd_ref with relu(pre) recovered from
    act = relu(pre)^2 (in float64 the rounding is none)."""
    return (g @ w2.T) * (2 * torch.sqrt(act.float() if act.dtype != torch.float64 else act).to(act.dtype))


def relu2_mlp_ref(x, w_fc, w_proj_t):
    """relu(x @ w_fc^T)^2 @ w_proj_t: the MLP after its input norm."""
    return linear_relu2_ref(x, w_fc)[1] @ w_proj_t


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _linear_relu2_tiles(
        # A (M, K) and B (N, K) operands; C (M, N) output: pre (forward) or dpre (backward); AUX (M, N): act,
        # written (forward), or pre, read (backward). ACT_ONLY: C is act (forward: AUX unused, C passed again) or
        # dpre (backward: AUX is act, read). Each has a unit last stride and 16-byte aligned rows.
        a_ptr, b_ptr, c_ptr, aux_ptr,
        M, N, K, stride_a, stride_b, stride_c, stride_aux,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,  # programs in the grid: each takes every NUM_PROGRAMS-th tile
        BACKWARD: tl.constexpr,  # False: C = pre, AUX = relu(pre)^2; True: C = acc * 2 relu(AUX)
        ACT_ONLY: tl.constexpr,  # forward: C = relu(pre)^2, no pre; backward: C = acc * 2 sqrt(AUX), AUX = act
        IEEE: tl.constexpr,  # fp32 operands: exact fp32 dots (no TF32)
):
    """The body of both kernels: this program's share of the (BLOCK_M, BLOCK_N) output tiles."""
    HALF: tl.constexpr = BLOCK_N // 2
    # TMA descriptors made on the device (C and AUX blocks are half a tile wide)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_c, 1], [BLOCK_M, HALF])
    aux_desc = tl.make_tensor_descriptor(aux_ptr, [M, N], [stride_aux, 1], [BLOCK_M, HALF])
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True):
        row = (tile // tiles_n) * BLOCK_M
        col = (tile % tiles_n) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([row, ks * BLOCK_K])
            b = b_desc.load([col, ks * BLOCK_K])
            if IEEE:
                acc = tl.dot(a, b.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        # the two column halves of the tile, one after the other
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        _epilogue(left, row, col, c_desc, aux_desc, BACKWARD, ACT_ONLY, IEEE)
        _epilogue(right, row, col + HALF, c_desc, aux_desc, BACKWARD, ACT_ONLY, IEEE)


# Two kernels, not one with BACKWARD as its argument: torch 2.11's C++ launcher keys the compiled kernels it loads by
# the function's name, so a graph's forward and backward would load one cubin for the two directions. ACT_ONLY stays
# a constexpr of each: a training run uses one mode, so each of its graphs launches one variant of each name.
@triton.jit
def _linear_relu2_fwd_kernel(a_ptr, b_ptr, c_ptr, aux_ptr, M, N, K, stride_a, stride_b, stride_c, stride_aux,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_PROGRAMS: tl.constexpr, ACT_ONLY: tl.constexpr, IEEE: tl.constexpr):
    """pre = A B^T (C) and act = relu(pre)^2 (AUX); ACT_ONLY: act alone (C)."""
    _linear_relu2_tiles(a_ptr, b_ptr, c_ptr, aux_ptr, M, N, K, stride_a, stride_b, stride_c, stride_aux,
                        BLOCK_M, BLOCK_N, BLOCK_K, NUM_PROGRAMS, False, ACT_ONLY, IEEE)


@triton.jit
def _linear_relu2_bwd_kernel(a_ptr, b_ptr, c_ptr, aux_ptr, M, N, K, stride_a, stride_b, stride_c, stride_aux,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_PROGRAMS: tl.constexpr, ACT_ONLY: tl.constexpr, IEEE: tl.constexpr):
    """dpre = (A B^T) * 2 relu(pre) (C), pre read from AUX; ACT_ONLY: * 2 sqrt(act), act read from AUX."""
    _linear_relu2_tiles(a_ptr, b_ptr, c_ptr, aux_ptr, M, N, K, stride_a, stride_b, stride_c, stride_aux,
                        BLOCK_M, BLOCK_N, BLOCK_K, NUM_PROGRAMS, True, ACT_ONLY, IEEE)


@triton.jit
def _epilogue(part, row, col, c_desc, aux_desc, BACKWARD: tl.constexpr, ACT_ONLY: tl.constexpr, IEEE: tl.constexpr):
    """Half a tile of fp32 accumulators at (row, col) -> pre and act (forward; ACT_ONLY: act alone, to C), or dpre
    (backward; relu(pre) from the saved pre, ACT_ONLY: from the saved act, the approximate fp32 sqrt(act) rounded to
    act's dtype, which gives back the stored relu(pre) wherever act is normal; fp32 operands (IEEE) take the correctly
    rounded sqrt, as rounding to fp32 leaves no margin for the approximation's error)."""
    if BACKWARD:
        saved = aux_desc.load([row, col]).to(tl.float32)
        if ACT_ONLY:
            if IEEE:
                relu = tl.sqrt_rn(saved)
            else:
                relu = tl.sqrt(saved).to(aux_desc.dtype).to(tl.float32)
        else:
            relu = tl.maximum(saved, 0.0)
        c_desc.store([row, col], (part * (2.0 * relu)).to(c_desc.dtype))
    else:
        pre = part.to(c_desc.dtype)
        r = tl.maximum(pre.to(tl.float32), 0.0)
        act = (r * r).to(c_desc.dtype)
        if ACT_ONLY:
            c_desc.store([row, col], act)
        else:
            c_desc.store([row, col], pre)
            aux_desc.store([row, col], act)


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per (direction, dtype size). bf16/fp16: chosen on one H200
# (`python -m benchmarks --only mlp --tune`, M = 16384). The backward's epilogue also holds pre's tile in shared
# memory: 4 stages of 128 x 256 x 64 do not fit (256 KB).
# fp32: small tiles that fit shared memory with IEEE dots (the tests' path).
CONFIGS = {
    ("fwd", 2): (128, 256, 64, 8, 4),
    ("bwd", 2): (128, 256, 64, 8, 3),
    ("fwd", 4): (64, 64, 32, 4, 2),
    ("bwd", 4): (64, 64, 32, 4, 2),
}
# What the benchmark's tuning pass times, per direction (each fits an H100/H200's 227 KB of shared memory).
TUNING_CANDIDATES = {
    "fwd": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
            (256, 128, 64, 8, 3), (128, 256, 32, 8, 5)],
    "bwd": [(128, 256, 64, 8, 2), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
            (256, 128, 64, 8, 3), (128, 256, 32, 8, 4)],
}
INTERPRETER_PROGRAMS = 3  # programs of the persistent grid in Triton's interpreter: several tiles per program


def _scratch(size, alignment, stream):
    """Triton's allocator for the global memory the kernel writes its TMA descriptors to (128 bytes each, per
    program): a torch tensor on the current CUDA device, from the caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


_KERNEL_NAMES = ("_linear_relu2_fwd_kernel", "_linear_relu2_bwd_kernel")


def scratch_per_program_in_cpp_wrapper():
    """Make inductor's C++ launcher (``--cpp-wrapper``) give these kernels their whole global scratch.

    Triton sizes a kernel's global scratch per program (512 bytes here: four descriptors; 384 for the act-only
    forward, whose unused AUX descriptor the compiler drops) and its own launcher
    allocates that times the grid; torch 2.11's C++ wrapper allocates it once, so programs 1.. would write
    their descriptors past the end of the buffer, over whatever the caching allocator put there. Where the C++
    wrapper does not multiply by the grid (read from its code generator: torch 2.13's does), the kernel
    parameters inductor records for it get the scratch of all NUM_PROGRAMS programs. Installed by
    compilation.cpp_wrapper_options (--cpp-wrapper), once."""
    try:
        from torch._inductor.codecache import CudaKernelParamCache
        from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
    except ImportError:  # no inductor: nothing launches these kernels from C++
        return False
    if "grid_0" in inspect.getsource(CUDADeviceOpOverrides.cpp_scratch):
        return False  # torch multiplies by the grid itself
    if getattr(CudaKernelParamCache, "_mlp_scratch_per_program", False):
        return False  # installed already
    record = CudaKernelParamCache.set.__func__

    def set_params(cls, key, params, *args, **kwargs):
        scratch = params.get("global_scratch")
        if scratch and key.startswith(_KERNEL_NAMES):
            programs = (params.get("triton_meta") or {}).get("constants", {}).get("NUM_PROGRAMS")
            if not isinstance(programs, int):
                raise RuntimeError(f"kernels/mlp.py: inductor recorded no NUM_PROGRAMS for {key}; its global scratch "
                                   f"({scratch} bytes per program) cannot be sized for the C++ launcher")
            params = dict(params, global_scratch=scratch * programs)
        return record(cls, key, params, *args, **kwargs)

    CudaKernelParamCache.set = classmethod(set_params)
    CudaKernelParamCache._mlp_scratch_per_program = True
    return True


def _traced(t):
    """Whether t is a value of torch.compile's trace rather than data: dynamo's (torch.compiler.is_compiling()) or
    AOT autograd's run of the ops' implementation over fake tensors (where is_compiling() need not hold)."""
    return torch.compiler.is_compiling() or is_fake(t)


def _programs(a, tiles, num_programs):
    """The persistent grid for operand a: num_programs (default the SM count), eagerly at most one per tile. Traced
    by torch.compile, num_programs whatever the tile count: the grid is the kernel's NUM_PROGRAMS, a compile-time
    constant, which a min() with the tile count of a dynamic M (train_gpt.py --dynamic-tokens) would tie to M (a
    recompile per M). Programs past the last tile find none (at the trainer's lengths the tiles outnumber the SMs:
    the grid is the same)."""
    if num_programs is None:
        num_programs = sm_count(a.device, INTERPRETER_PROGRAMS)
    if _traced(a):
        return num_programs
    return max(1, min(num_programs, tiles))


def _aligned(t):
    """Whether t's first element is 16-byte aligned. Traced, there is no data pointer to look at (nor a storage
    offset dynamo can read): there, True. The trainer's operands are fresh activations and whole rows of parameter
    banks, aligned by the caching allocator; a view at an unaligned offset must not reach this kernel from
    compiled code (TMA's behaviour is then undefined)."""
    if _traced(t):
        return True
    return t.data_ptr() % 16 == 0


def _tma_ready(t):
    """t, or a contiguous copy when t's layout is not one a TMA descriptor takes (16-byte aligned base and row
    stride, contiguous last dim)."""
    if t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and _aligned(t):
        return t
    return t.contiguous()


def _check(name, a, b, aux=None, aux_name="pre"):
    check_kernel_device(name, a.device)
    for arg, t in (("a", a), ("w", b)) + (((aux_name, aux),) if aux is not None else ()):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: {arg} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != a.dtype or t.device != a.device:
            raise ValueError(f"{name}: {arg} is {t.dtype} on {t.device}, the first operand {a.dtype} on {a.device}")
    if a.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {a.dtype} is not one of {DTYPES}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: inner dims differ: {tuple(a.shape)} @ {tuple(b.shape)}^T")
    M, N = a.shape[0], b.shape[0]
    if aux is not None and tuple(aux.shape) != (M, N):
        raise ValueError(f"{name}: {aux_name} must be {(M, N)}, got {tuple(aux.shape)}")
    if (N * a.element_size()) % 16:
        raise ValueError(f"{name}: the output's rows ({N} x {a.element_size()} bytes) must be a multiple of 16 bytes "
                         "(TMA)")
    if (a.shape[1] * a.element_size()) % 16:
        raise ValueError(f"{name}: the inner dim ({a.shape[1]} x {a.element_size()} bytes) must be a multiple of 16 "
                         "bytes (TMA)")


def _check_out(name, shape, like, **outs):
    for arg, t in outs.items():
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != like.dtype
                or t.device != like.device or not t.is_contiguous() or not _aligned(t)):
            raise ValueError(f"{name}: out {arg} must be a contiguous, 16-byte aligned {shape} {like.dtype} tensor on "
                             f"{like.device}")


def _launch(a, b, c, aux, backward, config, num_programs, act_only=False):
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0:
        return
    if K == 0:  # an empty sum: pre = 0, act = 0, dpre = 0
        c.zero_()
        if not backward:
            aux.zero_()
        return
    bm, bn, bk, warps, stages = config or CONFIGS[("bwd" if backward else "fwd", min(a.element_size(), 4))]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = _programs(a, tiles, num_programs)
    if not _traced(a):  # launched here, through Triton's allocator (traced: inductor brings the scratch)
        triton.set_allocator(_scratch)
        kernel = _linear_relu2_bwd_kernel if backward else _linear_relu2_fwd_kernel
    elif interpreting():
        raise RuntimeError("kernels/mlp.py: torch.compile cannot trace kernels that run in Triton's interpreter")
    else:  # recorded as a user-defined Triton kernel of the graph; each wrap_triton names its kernel, as torch's
        # search for a triton_op's kernels (its cache key) reads them
        kernel = wrap_triton(_linear_relu2_bwd_kernel) if backward else wrap_triton(_linear_relu2_fwd_kernel)
    kernel[(progs,)](a, b, c, aux, M, N, K, a.stride(0), b.stride(0), c.stride(0), aux.stride(0),
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=progs, ACT_ONLY=act_only,
                     IEEE=a.dtype == torch.float32,
                     num_warps=warps, num_stages=stages)


def linear_relu2(x, w, *, out=None, config=None, num_programs=None):
    """(pre, act): x (M, K) @ w (N, K)^T and relu(pre)^2, each (M, N) contiguous in x's dtype. out: a (pre, act)
    pair to write (contiguous, x's dtype and device; the tests pass NaN-filled ones). config: (BLOCK_M, BLOCK_N,
    BLOCK_K, num_warps, num_stages), default CONFIGS; num_programs: the persistent grid's size (default: the SM
    count, or INTERPRETER_PROGRAMS in Triton's interpreter)."""
    _check("linear_relu2", x, w)
    shape = (x.shape[0], w.shape[0])
    if out is None:
        out = (torch.empty(shape, dtype=x.dtype, device=x.device), torch.empty(shape, dtype=x.dtype, device=x.device))
    pre, act = out
    _check_out("linear_relu2", shape, x, pre=pre, act=act)
    _launch(_tma_ready(x), _tma_ready(w), pre, act, False, config, num_programs)
    return pre, act


def linear_relu2_bwd(g, w2, pre, *, out=None, config=None, num_programs=None):
    """dpre (M, N) contiguous = (g (M, K) @ w2 (N, K)^T) * 2 relu(pre (M, N)), rounded once. out: the dpre tensor
    to write; config and num_programs as in linear_relu2."""
    _check("linear_relu2_bwd", g, w2, pre)
    shape = (g.shape[0], w2.shape[0])
    dpre = out if out is not None else torch.empty(shape, dtype=g.dtype, device=g.device)
    _check_out("linear_relu2_bwd", shape, g, dpre=dpre)
    _launch(_tma_ready(g), _tma_ready(w2), dpre, _tma_ready(pre), True, config, num_programs)
    return dpre


def linear_relu2_act(x, w, *, out=None, config=None, num_programs=None):
    """act (M, N) contiguous = relu(x (M, K) @ w (N, K)^T)^2 in x's dtype, the same bits as linear_relu2's act;
    pre is neither written nor allocated. out: the act tensor to write; config and num_programs as in
    linear_relu2."""
    _check("linear_relu2_act", x, w)
    shape = (x.shape[0], w.shape[0])
    act = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    _check_out("linear_relu2_act", shape, x, act=act)
    _launch(_tma_ready(x), _tma_ready(w), act, act, False, config, num_programs, act_only=True)
    return act


def linear_relu2_bwd_act(g, w2, act, *, out=None, config=None, num_programs=None):
    """dpre (M, N) contiguous = (g (M, K) @ w2 (N, K)^T) * 2 sqrt(act (M, N)), rounded once: linear_relu2_bwd with
    relu(pre) recovered from the saved act = relu(pre)^2 (act >= 0). out, config and num_programs as in
    linear_relu2_bwd."""
    _check("linear_relu2_bwd_act", g, w2, act, aux_name="act")
    shape = (g.shape[0], w2.shape[0])
    dpre = out if out is not None else torch.empty(shape, dtype=g.dtype, device=g.device)
    _check_out("linear_relu2_bwd_act", shape, g, dpre=dpre)
    _launch(_tma_ready(g), _tma_ready(w2), dpre, _tma_ready(act), True, config, num_programs, act_only=True)
    return dpre


# ---------------------------------------------------------------------------------------------------------
# Autograd (custom ops whose implementations torch.compile traces: the kernels become user-defined Triton kernels)
# ---------------------------------------------------------------------------------------------------------
# The hash of this module's source, an argument of speedrun::relu2_mlp that its implementation ignores: dynamo
# writes it into the graph as a constant, so AOT autograd's cache key, which holds dynamo's graph and the kernels'
# source but not the Python of the launchers, the ops or the backward, changes with any edit of this module.
SOURCE_KEY = int.from_bytes(hashlib.sha256(Path(__file__).read_bytes()).digest()[:7], "big")


_OPS = {}  # act_only -> the op relu2_mlp calls (register_ops)


def register_ops():
    """Register the custom ops, once: {False: speedrun::relu2_mlp, True: speedrun::relu2_mlp_act_only}, each with its
    backward op and autograd. Registering a triton_op imports torch's compiler (dynamo, inductor, sympy: about as
    long to import as torch), which a process that never runs the fused MLP (``train_gpt.py --help``, the CPU's runs)
    need not pay, so this module registers nothing at import: relu2_mlp registers at its first eager call, and a
    process that compiles relu2_mlp calls this first (train_gpt.build_fns does): dynamo cannot trace the
    registration."""
    if _OPS:
        return _OPS

    @triton_op("speedrun::relu2_mlp", mutates_args=())
    def _relu2_mlp_op(x: torch.Tensor, w_fc: torch.Tensor, w_proj_t: torch.Tensor,
                      source_key: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out, pre, act): pre and act are outputs only so that setup_context can keep them for the backward.
        source_key: SOURCE_KEY (unused here)."""
        pre, act = linear_relu2(x, w_fc)
        return act @ w_proj_t, pre, act

    @_relu2_mlp_op.register_fake
    def _(x, w_fc, w_proj_t, source_key):
        # Shapes only (triton_op's default fake runs the implementation, whose launches dynamo's fake run cannot make
        # in Triton's interpreter). AOT autograd still traces the implementation itself.
        M, H = x.shape[0], w_fc.shape[0]
        return x.new_empty((M, w_proj_t.shape[1])), x.new_empty((M, H)), x.new_empty((M, H))

    def backward_op(name, launcher):
        """The backward kernel's launcher as the op speedrun::NAME: (g, w2, saved pre or act) -> dpre."""
        @triton_op(f"speedrun::{name}", mutates_args=())
        def op(g: torch.Tensor, w2: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
            return launcher(g, w2, saved)

        @op.register_fake
        def _(g, w2, saved):
            return g.new_empty((g.shape[0], w2.shape[0]))
        return op

    _linear_relu2_bwd_op = backward_op("linear_relu2_bwd", linear_relu2_bwd)
    _linear_relu2_bwd_act_op = backward_op("linear_relu2_bwd_act", linear_relu2_bwd_act)

    def _relu2_mlp_setup_context(ctx, inputs, output):
        x, w_fc, w_proj_t, _ = inputs
        _, pre, act = output
        ctx.save_for_backward(x, w_fc, w_proj_t, pre, act)
        ctx.mark_non_differentiable(pre, act)
        ctx.set_materialize_grads(False)  # no zeros for pre's and act's gradients, which the backward ignores

    def _relu2_mlp_backward(ctx, dy, _dpre, _dact):
        x, w_fc, w_proj_t, pre, act = ctx.saved_tensors
        dpre = _linear_relu2_bwd_op(dy, w_proj_t, pre)
        return dpre @ w_fc, dpre.T @ x, act.T @ dy, None

    _relu2_mlp_op.register_autograd(_relu2_mlp_backward, setup_context=_relu2_mlp_setup_context)

    @triton_op("speedrun::relu2_mlp_act_only", mutates_args=())
    def _relu2_mlp_act_only_op(x: torch.Tensor, w_fc: torch.Tensor, w_proj_t: torch.Tensor,
                               source_key: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(out, act), the act-only mode: act is an output only so that setup_context can keep it (no pre).
        source_key: SOURCE_KEY (unused here)."""
        act = linear_relu2_act(x, w_fc)
        return act @ w_proj_t, act

    @_relu2_mlp_act_only_op.register_fake
    def _(x, w_fc, w_proj_t, source_key):
        M, H = x.shape[0], w_fc.shape[0]
        return x.new_empty((M, w_proj_t.shape[1])), x.new_empty((M, H))

    def _relu2_mlp_act_only_setup_context(ctx, inputs, output):
        x, w_fc, w_proj_t, _ = inputs
        _, act = output
        ctx.save_for_backward(x, w_fc, w_proj_t, act)
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)

    def _relu2_mlp_act_only_backward(ctx, dy, _dact):
        x, w_fc, w_proj_t, act = ctx.saved_tensors
        dpre = _linear_relu2_bwd_act_op(dy, w_proj_t, act)
        return dpre @ w_fc, dpre.T @ x, act.T @ dy, None

    _relu2_mlp_act_only_op.register_autograd(_relu2_mlp_act_only_backward,
                                             setup_context=_relu2_mlp_act_only_setup_context)

    _OPS.update({False: _relu2_mlp_op, True: _relu2_mlp_act_only_op})
    return _OPS


def relu2_mlp(x, w_fc, w_proj_t, act_only=False):
    """relu(x @ w_fc^T)^2 @ w_proj_t, x (M, C), w_fc and w_proj_t (H, C), differentiable in all three: the
    up-projection and ReLU² in linear_relu2 (forward) and linear_relu2_bwd (backward), the other matmuls in
    torch (cuBLAS). act_only (train_gpt.py --mlp-act-only): linear_relu2_act and linear_relu2_bwd_act instead, so
    the forward saves act alone (no pre) and the backward takes relu(pre) from it. The op speedrun::relu2_mlp (or
    speedrun::relu2_mlp_act_only) in torch.compile's graphs."""
    if not _OPS:
        if torch.compiler.is_compiling():
            raise RuntimeError("kernels.mlp.relu2_mlp under torch.compile: call kernels.mlp.register_ops() before "
                               "compiling (dynamo cannot trace the ops' registration)")
        register_ops()
    return _OPS[bool(act_only)](x, w_fc, w_proj_t, SOURCE_KEY)[0]
