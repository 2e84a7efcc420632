"""Compiles the Triton kernels of kernel families for an H100/H200 (sm_90a) on a machine without a GPU.

``python tests/sm90_compile_worker.py FAMILY[:sass] [FAMILY[:sass] ...] [--sass] [--jobs N]`` (run by
tests/test_sm90_compile.py;
TRITON_INTERPRET must be unset, so that ``@triton.jit`` makes real JIT functions): calls each family's launchers
the way train_gpt.py does, with the launch configurations the GPU uses, on small CPU tensors. Nothing is launched:
``JITFunction.run`` is replaced by a recorder, and each launcher's device check is waived. Every distinct launch
(kernel, argument types, constexpr values, launch options) is then compiled with ``triton.compile`` for target
("cuda", 90): Triton to TTIR, TTGIR, LLVM IR, PTX, and ptxas to a cubin. Prints, per family in the order given, a
JSON line {"family", "defined": the family module's kernels (its ``*_kernel`` JIT functions)}, then one per
launch: {"family", "kernel", "signature", "constexprs", "options", "ok", "error"} (error: the compiler's last
lines); a family whose launchers raise prints {"family", "error"} instead. ``--jobs N``: N processes, forked after
the imports, each compiling whole families (default 1: all in this process); the families' lines still come in
the order given.

Why: the CPU tests run the kernels in Triton's interpreter, which accepts programs the GPU compiler rejects
(and the reverse); this catches the GPU compiler's errors in CI. Argument types are mapped as Triton's launcher
maps them (tensors: typed pointers; ints: i32, or i64 beyond int32; floats: fp32; bools: i1), without its
specialisations (16-byte divisibility, integers equal to 1), which change the code, not whether it compiles.

``--sass`` (or ``FAMILY:sass`` for one family, whose lines then say ``"family": "FAMILY:sass"``; the same family
may come plain and with ``:sass`` in one run): compile with the 16-byte divisibility the GPU launcher specialises on (tensors whose address, and
integers whose value, is a multiple of 16: the vector loads and stores of the real launch; integers equal to 1
are not specialised) and add to each row "sass": the instruction counts of the cubin disassembled by the nvdisasm
in Triton's wheel, {"instructions", "mufu", "loop_instructions", "loop_mufu", "inner_loops"}, the loop being the
longest span that a branch jumps back over (a row kernel's tile loop; 0 without one) and "inner_loops" the
[instructions, mufu] of every such span that holds no other (the tile loops inside the fused kernel's row loop).
For the GPU machines' figures run it with their Triton (3.6; e.g. ``pip install --target DIR triton==3.6.0`` and
DIR first on PYTHONPATH). Static counts, not times: on Hopper a scheduler issues one instruction per cycle and its
special-function unit (MUFU) takes 8 cycles per warp instruction, so they bound a loop's cycles from below
(notes/measurements.md has the counts of the cross-entropy kernels).
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_PTR = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
        torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e5m2: "fp8e5",
        torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


def _type_of(value):
    if isinstance(value, torch.Tensor):
        return "*" + _PTR[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def _divisible_by_16(value):
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value != 0 and value % 16 == 0


def record_launches():
    """Replace JITFunction.run by a recorder; returns the list it fills with (kernel, signature, constexprs,
    options, attrs) for each launch (attrs: the 16-byte divisibility of the arguments, for --sass)."""
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        bound = dict(zip(self.arg_names, args)) | kwargs
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(self.arg_names):
            value = bound[name]
            if i in self.constexprs or value is None:
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = _type_of(value)
                if _divisible_by_16(value):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        launches.append((self, signature, constexprs, options, attrs))

    JITFunction.run = run
    return launches


def waive_device_checks():
    """The launchers refuse CPU tensors outside the interpreter; here they only build arguments."""
    import kernels
    import kernels._checks as checks
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(kernels.__name__ + ".") and hasattr(mod, "check_kernel_device"):
            mod.check_kernel_device = lambda name, device: None
    checks.check_kernel_device = lambda name, device: None


def call_family(family):
    """The launches train_gpt.py makes with this family's kernels (GPU dtypes and configurations), at small
    shapes: an aligned one (unmasked paths) and, where the kernel has masked tails, a ragged one."""
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    if family == "adam":
        from kernels.adam import fused_adamw_multi_step
        for dtype, master in ((bf16, True), (torch.float32, False)):   # the head/embeddings; gates and scalars
            shapes = [(1024,), (77, 5)]
            params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            grads = [torch.randn(s, generator=g) for s in shapes]
            moments = [[torch.zeros(s) for s in shapes] for _ in range(2)]
            masters = [p.float() for p in params] if master else [None] * len(params)
            hps = [dict(lr=1e-3 * (i + 1), beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0, step=1)
                   for i in range(len(shapes))]
            fused_adamw_multi_step(params, grads, *moments, masters, hps, cautious_wd=True)
    elif family == "cross_entropy":
        import kernels.cross_entropy as ce
        for N, V, extra in ((128, 4096, False), (37, 1000, False), (128, 4096, True)):
            x = torch.randn(N, V, generator=g).to(bf16)
            t = torch.randint(0, V, (N,), generator=g)
            w = torch.tensor([1.0, 0.5, 0.25])
            if extra:  # --prefix-loss: targets (2, N), the last weight the extra term's (PREFIX_AT = 3)
                t, w = torch.stack([t, torch.randint(-1, V, (N,), generator=g)]), torch.tensor([1.0, 0.5, 0.25, 0.25])
            cfg = ce.DEFAULT_CONFIG[bf16]
            losses, stats = ce.softcapped_cross_entropy_fwd(x, t, w, 23.0, 5.0, 7.5, config=cfg)
            grad = torch.full((N,), 1.0 / N)
            ce.softcapped_cross_entropy_bwd(grad, x, stats, t, w, 23.0, 5.0, 7.5, config=cfg)
            ce.softcapped_cross_entropy_bwd_e5m2(grad, x, stats, t, w, 23.0, 5.0, 7.5, 2.0 ** -20, config=cfg)
            fused = ce.FWD_GRAD_CONFIG[bf16]        # the gradient in the forward (--ce-grad-in-forward)
            ce.softcapped_cross_entropy_fwd_grad(x, t, w, 23.0, 5.0, 7.5, 1.0 / N, out=x.clone(), config=fused)
            ce.softcapped_cross_entropy_fwd_grad_e5m2(x, t, w, 23.0, 5.0, 7.5, 1.0 / N, 2.0 ** -20, config=fused)
    elif family == "embedding":
        import kernels.embedding as emb
        for N, V, C in ((1024, 512, 768), (999, 300, 100)):
            ids = torch.randint(0, V, (N,), generator=g)
            grad = torch.randn(N, C, generator=g).to(bf16)
            prep = emb.prepare_ids(ids, V)
            emb.embedding_backward(grad, ids, V, prep=prep, config=emb.DEFAULT_CONFIG)
            emb.embedding_backward_accumulate(grad, ids, torch.zeros(V, C), prep=prep, config=emb.DEFAULT_CONFIG)
    elif family == "mlp":
        from kernels.mlp import linear_relu2, linear_relu2_act, linear_relu2_bwd, linear_relu2_bwd_act
        for M, N, K in ((256, 512, 128), (37, 72, 40)):
            x, w = torch.randn(M, K, generator=g).to(bf16), torch.randn(N, K, generator=g).to(bf16)
            pre, act = linear_relu2(x, w, num_programs=132)
            linear_relu2_bwd(x, w, pre, num_programs=132)
            linear_relu2_act(x, w, num_programs=132)  # --mlp-act-only
            linear_relu2_bwd_act(x, w, act, num_programs=132)
    elif family == "momentum":
        from kernels.momentum import nesterov_momentum
        for shape in ((4, 768, 768), (3, 100, 70)):
            nesterov_momentum(torch.randn(shape, generator=g), torch.zeros(shape), 0.95)
    elif family == "normuon":
        from kernels.normuon import normuon_update
        for (k, M, N) in ((4, 3072, 768), (3, 100, 70)):
            o = torch.randn(k, M, N, generator=g).to(bf16)
            v2 = torch.zeros((k, M, 1) if M >= N else (k, 1, N))
            master = torch.randn(k, M, N, generator=g)
            normuon_update(o, v2, master, torch.ones(k), torch.empty(k, M, N, dtype=bf16), lr=0.02, beta2=0.95,
                           wd=0.01)
    elif family == "polar_express":
        from kernels.polar_express import polar_express
        for shape in ((24, 768, 768), (4, 3072, 768), (3, 100, 70)):
            polar_express(torch.randn(shape, generator=g).to(bf16), normalized=True, plans=False)
        polar_express(torch.randn(3, 100, 70, generator=g).to(bf16), plans=False)   # normalises itself
    elif family == "transpose":
        from kernels.transpose import transpose_add, transpose_copy
        for M, N in ((768, 1024), (100, 70)):
            for dtype in (bf16, torch.float8_e5m2, torch.float8_e4m3fn):
                src = torch.randn(M, N, generator=g).to(dtype)
                transpose_copy(src, torch.empty(N, M, dtype=dtype))
            transpose_add(torch.randn(M, N, generator=g).to(bf16), torch.zeros(N, M, dtype=bf16))
    else:
        raise SystemExit(f"unknown family {family!r}")


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def sass_counts(cubin):
    """{"instructions", "mufu", "loop_instructions", "loop_mufu", "inner_loops"} of a cubin (nvdisasm from Triton's
    wheel)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line.strip())}
    spans = []                       # (first, last) line of every span a branch jumps back over
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    loop = max(spans, key=lambda s: s[1] - s[0], default=(0, -1))

    def count(span):
        ops = [m.group(1) for m in map(_OPCODE.search, span) if m]
        return len(ops), sum(op.startswith("MUFU") for op in ops)

    (n, mufu), (ln, lmufu) = count(lines), count(lines[loop[0]:loop[1] + 1])
    if ln <= 1:                      # no loop: only the branch-to-itself after EXIT
        ln, lmufu = 0, 0
    inner = [count(lines[a:b + 1]) for a, b in spans
             if b - a > 1 and not any(a <= c and d <= b and (c, d) != (a, b) and d - c > 1 for c, d in spans)]
    return dict(instructions=n, mufu=mufu, loop_instructions=ln, loop_mufu=lmufu, inner_loops=inner)


def compile_family(entry, sass=False):
    """The JSON lines of one family, FAMILY or FAMILY:sass (module docstring)."""
    family, _, mode = entry.partition(":")
    sass = sass or mode == "sass"
    launches = record_launches()
    try:
        call_family(family)
    except Exception:  # noqa: BLE001 - reported, the test fails on it
        return [json.dumps(dict(family=entry, error="".join(traceback.format_exc().splitlines(True)[-12:])))]
    module = sys.modules[f"kernels.{family}"]
    defined = sorted(n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel"))
    lines = [json.dumps(dict(family=entry, defined=defined))]
    seen = set()
    for fn, signature, constexprs, options, attrs in launches:
        key = (fn.__name__, json.dumps(signature), repr(sorted(constexprs.items())), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        row = dict(family=entry, kernel=fn.__name__, signature=signature,
                   constexprs={k: repr(v) for k, v in constexprs.items()}, options=options, ok=True, error="")
        try:
            src = ASTSource(fn, signature, constexprs, attrs if sass else None)
            compiled = triton.compile(src, target=TARGET, options=options)
            if sass:
                row["sass"] = sass_counts(compiled.asm["cubin"])
        except Exception:  # noqa: BLE001 - reported, the test fails on it
            row.update(ok=False, error="".join(traceback.format_exc().splitlines(True)[-12:]))
        lines.append(json.dumps(row))
    return lines


def main(families, sass=False, jobs=1):
    import importlib
    for entry in families:  # imported before the fork, so that each process does not import them again
        importlib.import_module(f"kernels.{entry.partition(':')[0]}")
    waive_device_checks()
    if jobs <= 1:
        results = (compile_family(f, sass) for f in families)
    else:  # fork: nothing has run a torch operator yet (no thread pool to inherit)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        # (a process that dies, e.g. in the compiler, raises BrokenProcessPool here instead of hanging)
        with ProcessPoolExecutor(min(jobs, len(families)), mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(compile_family, families, [sass] * len(families)))
    for lines in results:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="+", metavar="FAMILY[:sass]")
    ap.add_argument("--sass", action="store_true", help="16-byte specialised, with the cubins' instruction counts")
    ap.add_argument("--jobs", type=int, default=1, help="processes compiling families in parallel")
    a = ap.parse_args()
    main(a.families, sass=a.sass, jobs=a.jobs)
