"""Compilation around a run of train_gpt.py: the report of its compile warmup and --compile-cache.

``Compilation`` is a run's compile side, whether it compiles or not (hp.compile): it opens --compile-cache, runs
and reports the compile warmup, and checks that the timed run compiled nothing more.

The report (``compile_report``, from torch's per-frame compilation records): one ``compile_report:`` line per
compiled frame (dynamo tracing, AOT autograd, inductor and Triton seconds, the lazily compiled backward,
FX-graph cache hits) and a total; the cache state, "cold", "warm" or "partly warm", is the ``compile_cache:``
line. ``log_compilation`` writes these after the warmup.

--compile-cache PATH (``CompileCache``, opened before anything compiles): compiled artefacts kept between
processes, stamped with the versions, the GPU and the hash of the code that ran. With it the training and
validation steps are ``Precompiled``: each graph compiled ahead of time as a whole function (torch's
``aot_compile``) and saved there, so that a later run loads it without dynamo's trace or the caches' lookups.

``AheadProcess``: a second process that compiles a graph into the compile caches this process reads, while this
one compiles another (train_gpt.py: the validation step and the training step's other micro-batch lengths, beside
the first training step's compile): this process then loads that graph from the cache instead of compiling it.
None start where the inductor cache holds a mark (``compiled_mark``) that a run of the same graphs finished its
compile warmup with it: loading them, such processes would only slow the warmup.

``cpp_wrapper_options()``: the training step's inductor options under --cpp-wrapper, an opt-in outside the public
speedrun's rules (no compile options beyond record #74's); it first installs what torch 2.11's C++ launcher needs
(``int_arrays_keyed_by_their_buffer``, kernels.mlp's ``scratch_per_program_in_cpp_wrapper``). The default
configuration installs nothing into torch.
"""
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from run_log import dir_bytes, source_dump


# The training step's inductor options under --cpp-wrapper (cpp_wrapper_options). store_cubin: torch 2.11 sets it
# for a C++ wrapper's forward graph but not always for its backward one, whose code then loads no kernel, or the
# forward's kernel of the same name. build_separate: the launcher's C++ entry built at -O1 apart from its kernel
# declarations, not all in one file at -O3 (a shorter cold compile, steps no slower).
CPP_WRAPPER_OPTIONS = {"cpp_wrapper": True, "triton.store_cubin": True, "cpp_wrapper_build_separate": True}

# How long the compile warmup waits, when it needs the graph, for an AheadProcess still compiling it: the processes
# start before the warmup's own first graph, which takes about as long as theirs
AHEAD_WAIT_S = 120.0


def int_arrays_keyed_by_their_buffer():
    """Backport to torch 2.11 of torch 2.13's fix to the C++ wrapper's cache of size/stride arrays.

    The C++ wrapper declares each size or stride array once (``int_array_N``) and caches the name under the id of
    the ``writeline`` bound method it was written with. A bound method is a new object at every attribute access,
    so its id is soon reused: an array declared inside the scope of a custom op's Python call could be named
    again at the function's top level, where it does not exist (a C++ compile error such as "'int_array_37' was
    not declared in this scope" in a training step with the fused MLP traced into it). Here the key is the buffer
    the method writes to, kept alive by the cache. ``cpp_wrapper_options`` installs it where the wrapper still
    keys on the method (read from its source); returns whether it installed."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return False
    if "__self__" in inspect.getsource(CppWrapperCpu.codegen_int_array_var):
        return False  # torch's own fix is there

    def codegen_int_array_var(self, int_array, writeline, known_statically=False, graph=None):
        cache = self.__dict__.setdefault("_int_arrays_by_buffer", {})
        owner = getattr(writeline, "__self__", writeline)
        key = (int_array, id(owner), known_statically, id(graph) if graph else None)
        if key not in cache:
            cache[key] = (self._codegen_int_array_var_impl(int_array, writeline, known_statically), owner)
        return cache[key][0]

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
    return True


def cpp_wrapper_options():
    """The inductor options of a training step compiled with --cpp-wrapper (train_gpt.build_fns; tests/test_mlp.py
    compiles the fused MLP with them), after installing the two fixes torch 2.11's C++ launcher needs (each
    installs once, and nothing where torch has its own)."""
    from kernels.mlp import scratch_per_program_in_cpp_wrapper
    int_arrays_keyed_by_their_buffer()
    scratch_per_program_in_cpp_wrapper()
    return dict(CPP_WRAPPER_OPTIONS)


def unique_graphs():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def compile_metrics():
    """torch's per-frame compilation records (forward frames and their lazily compiled backwards)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
        return list(get_compilation_metrics())
    except (ImportError, AttributeError):
        return []


def _us(m, field):
    v = getattr(m, field, None)
    return (v or 0) / 1e6


def _cache_counts(entries, prefix):
    """(hits, lookups) of one of torch's caches over a frame's metrics entries (None: no entry); a count torch
    does not record reads 0."""
    hits = sum(getattr(x, f"{prefix}_hit_count", 0) or 0 for x in entries if x)
    return hits, hits + sum(getattr(x, f"{prefix}_miss_count", 0) or 0 for x in entries if x)


def compile_report(metrics, phases, ahead=frozenset(), more=(0, 0)):
    """(lines, cache state): one `compile_report:` line per compiled frame (dynamo tracing, AOT autograd, inductor,
    Triton compilation, the backward's inductor and Triton time, the FX-graph and AOT-autograd cache hits) and a
    total; the cache state, from the FX-graph cache, is "cold" (no graph came from the inductor cache), "warm" (all
    did) or "partly warm (h of n graphs from the cache)". ahead: the frames ("train_step [0/1]") whose graphs a
    second process of this run compiled (AheadProcess): their lines say so, and the state leaves them out (it
    says what the caches held when the run started). more: (hits, lookups) of the FX graph cache outside frames
    (Precompiled's compiles), added to the state's."""
    lines, (hits, lookups) = [], more
    backward = {m.compile_id: m for m in metrics if getattr(m, "is_forward", True) is False}
    # frames only: torch also records entries without a code object (runtime events), which carry no times
    metrics = [m for m in metrics if getattr(m, "co_name", None) is not None or m in backward.values()]
    for m in metrics:
        if getattr(m, "is_forward", True) is False:
            continue
        total = getattr(m, "entire_frame_compile_time_s", None) or 0.0
        aot, ind, tri = (_us(m, f) for f in ("aot_autograd_cumulative_compile_time_us",
                                               "inductor_cumulative_compile_time_us", "triton_compile_time_us"))
        b = backward.get(m.compile_id)
        b_total = _us(b, "backward_cumulative_compile_time_us") if b else 0.0
        b_tri = _us(b, "triton_compile_time_us") if b else 0.0
        h, n = _cache_counts((m, b), "inductor_fx_local_cache")
        frame = f"{m.co_name} [{m.compile_id}]"
        if frame not in ahead:
            hits, lookups = hits + h, lookups + n
        ah, an = _cache_counts((m, b), "aotautograd_local_cache")
        lines.append(f"compile_report: frame {frame} ops {getattr(m, 'graph_op_count', '?')}: "
                     f"{total:.1f} s (dynamo {total - aot:.1f}, aot_autograd {aot - ind:.1f}, inductor "
                     f"{ind:.1f} of which triton {tri:.1f}), lazily compiled backward {b_total:.1f} s (triton "
                     f"{b_tri:.1f}); fx_graph_cache {h}/{n} hits; aot_autograd_cache {ah}/{an} hits"
                     + ("; compiled by a second process" if frame in ahead else ""))
    # A frame's inductor time holds both of its graphs where AOT autograd compiles the backward together with
    # the forward (torch 2.11 on our GPUs: the backward's own entry then reads 0).
    frames = sum(1 for m in metrics if getattr(m, "is_forward", True) is not False)
    compile_s = sum((getattr(m, "entire_frame_compile_time_s", None) or 0.0) for m in metrics) + sum(
        _us(m, "backward_cumulative_compile_time_us") for m in backward.values())
    wall = sum(s for _, s in phases)
    lines.append(f"compile_report: {frames} frames compiled, {unique_graphs()} graphs, compile {compile_s:.1f} s of "
                 f"the warmup's {wall:.1f} s (the rest: first launches of our Triton kernels, running the steps)")
    state = ("cold" if lookups == 0 or hits == 0 else "warm" if hits == lookups
             else f"partly warm ({hits} of {lookups} graphs from the cache)")
    return lines, state


def inductor_cache_dir():
    """Where inductor keeps compiled graphs and its Triton kernels (TORCHINDUCTOR_CACHE_DIR, else its default), from
    torch's own cache_dir(). Before torch._inductor is imported its module is loaded from its file: importing it by
    name first runs that package (a second or more, dynamo with it), which a run's startup imports later on a second
    thread (train_gpt.Trainer: build_fns beside the parameters), after Compilation read its compiled_mark."""
    name = "torch._inductor.runtime.cache_dir_utils"
    module = sys.modules.get(name)
    if module is None and "torch._inductor" not in sys.modules:
        path = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
        try:
            spec = importlib.util.spec_from_file_location("_inductor_cache_dir_utils", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError, AttributeError):
            module = None
    return Path((module or importlib.import_module(name)).cache_dir())


def compiled_mark(key):
    """The file in the inductor cache that says a run whose compiled graphs have ``key`` (train_gpt.graphs_key)
    finished its compile warmup with this cache (Compilation.warmup writes it)."""
    return inductor_cache_dir() / "train_gpt_compiled" / key


def triton_cache_dir():
    """Where Triton keeps the binaries of our own @triton.jit kernels (TRITON_CACHE_DIR, else ~/.triton/cache)."""
    knobs = getattr(triton, "knobs", None)
    path = getattr(getattr(knobs, "cache", None), "dir", None) if knobs is not None else None
    return Path(path or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


class CompileCache:
    """--compile-cache PATH: compile artifacts a user can keep (another process, another day, a copy on another
    machine of the same kind). PATH holds inductor's cache (compiled graphs, their Triton kernels), the Triton
    cache of our own kernels, aot/KEY/ (the training and validation steps as whole compiled functions, Precompiled,
    per train_gpt.graphs_key) and stamp.json: the torch / Triton / CUDA / Python versions, the GPU and the sha256
    of the source that ran. At start (before anything compiles), a matching stamp points inductor and
    Triton at PATH (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): the compile then reads finished artifacts.
    A stamp that differs is reported in one line and PATH is emptied: the run compiles cold. After the warmup
    the caches the run used are copied into PATH (when it was not reading from there already) and stamped; the
    whole compiled functions are written there as they compile."""

    def __init__(self, path, stamp):
        self.path, self.stamp = Path(path), stamp
        self.loaded, self.why = False, ""

    @staticmethod
    def current_stamp(device):
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                "python": platform.python_version(), "gpu": gpu,
                "code": hashlib.sha256(source_dump().encode()).hexdigest()[:16]}

    def open(self, owner=True):
        """Read PATH's stamp and point the compilers at PATH if it matches; call before any compilation. owner (rank
        0, which opens first): empties what does not match."""
        stamp_file = self.path / "stamp.json"
        if self.path.exists() and not self.path.is_dir():
            raise FileNotFoundError(f"--compile-cache {self.path}: exists and is not a directory")
        if stamp_file.is_file():
            try:
                old = json.loads(stamp_file.read_text())
            except (OSError, ValueError):
                old = {}
            diff = [k for k in self.stamp if old.get(k) != self.stamp[k]]
            if not diff:
                self.loaded = True
            else:
                self.why = ("made with " + ", ".join(f"{k} {old.get(k)}" for k in diff) + "; this run has "
                            + ", ".join(f"{k} {self.stamp[k]}" for k in diff) + ": emptied, compiling")
                for sub in ("inductor", "triton", "aot", "stamp.json"):
                    p = self.path / sub
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        elif self.path.is_dir() and any(self.path.iterdir()):
            self.why = "no stamp.json (an interrupted save?): compiling"
        else:
            self.why = "empty: compiling"
        if owner and not self.loaded:  # an unstamped save's whole functions may be another code's
            shutil.rmtree(self.path / "aot", ignore_errors=True)
        if self.loaded:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.path / "inductor")
            os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")
        return self

    def describe(self, state):
        if self.loaded:
            return f"loaded {self.path} ({state})"
        return f"{state} (--compile-cache {self.path}: {self.why})"

    def save(self):
        """Copy the caches the run used into PATH (unless it read from there), write the stamp; the log line."""
        t0 = time.perf_counter()
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.loaded:
            for src, name in ((inductor_cache_dir(), "inductor"), (triton_cache_dir(), "triton")):
                if src.is_dir():
                    copy_cache_tree(src, self.path / name)
        (self.path / "stamp.json").write_text(json.dumps(self.stamp, indent=1) + "\n")
        size = dir_bytes(self.path) / 2 ** 20
        return f"compile_cache_saved: {self.path} {size:.0f} MiB in {time.perf_counter() - t0:.1f} s"


# The attributes torch.compile's dimension marks (torch._dynamo.mark_dynamic and its kin) leave on a tensor. A loaded
# Precompiled function's guards refuse a tensor that carries them (torch 2.11 and 2.13: "present on runtime tensor
# but was absent at compile time"), though the function compiled with them: Precompiled strips them from its
# inputs once the function exists (they only tell a compile which sizes vary).
DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
             "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_has_dynamo_dim_marking")

# What Precompiled did since the last log_compilation, one (kind, line, FX graph cache hits, lookups) per function:
# kind "loaded", "compiled" (and saved) or "plain" (left to torch.compile); log_compilation logs the lines
PRECOMPILED = []


def call_signature(args):
    """A string naming what a compiled function's guards depend on in ``args``: the nesting (dicts' keys, tuples'
    lengths and types), each tensor's dtype, device (with its index: each rank keeps its own graphs, whose code may
    name the GPU they were compiled for), size and stride (-1 in a dimension marked dynamic) and requires_grad, and each
    other leaf's type and value. Calls with one signature share one compiled graph."""
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    parts = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            dyn = getattr(x, "_dynamo_dynamic_indices", set())
            size = tuple(-1 if i in dyn else n for i, n in enumerate(x.shape))
            stride = tuple(-1 if i in dyn else n for i, n in enumerate(x.stride()))
            parts.append(f"tensor {x.dtype} {x.device} {size} {stride} {x.requires_grad}")
        else:
            parts.append(f"{type(x).__name__} {x!r}" if isinstance(x, (bool, int, float, str, type(None)))
                         else type(x).__name__)
    return "\n".join(parts)


def quick_signature(leaves):
    """A hashable stand-in for call_signature of the call whose pytree leaves are ``leaves``, cheaper to make (one
    per call): each leaf's type and, for a tensor, its sizes, strides, dtype, device and requires_grad (a dynamic
    size as it is: one entry per count of documents), else the leaf itself. Calls with equal quick signatures and
    one nesting have equal signatures (a nesting that changed is for the function's guards to refuse)."""
    return tuple((type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
                 if isinstance(x, torch.Tensor) else (type(x), x) for x in leaves)


class Precompiled:
    """--compile-cache's whole compiled functions: ``fn`` compiled ahead of time per call signature
    (``torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile``: dynamo's trace, AOT
    autograd's forward and backward graphs and inductor's code with its Triton kernels, in one file), kept in
    ``folder`` as NAME-SIGNATURE_HASH.aot. A call whose signature has a file there loads it (no dynamo trace, no
    cache lookups); one without compiles it and writes the file. The result is the function torch.compile would
    have built: the same graphs and kernels. A file that does not load is compiled again; guards that refuse the
    call, or a compile ahead of time that fails, leave the signature to ``fallback`` (the plain torch.compile of
    fn). Each step is one entry of PRECOMPILED. torch 2.11 needs torch._dynamo.config.enable_aot_compile set, which
    the constructor does (a compiler setting: only --compile-cache, an opt-in, makes a Precompiled)."""

    def __init__(self, fn, name, folder, fallback, options=None):
        self.fn, self.name, self.folder, self.fallback, self.options = fn, name, Path(folder), fallback, options
        self.fns = {}  # signature hash -> the compiled function (None: use the fallback)
        self.keys = {}  # quick_signature -> signature hash (call_signature costs ~4x as much, per micro-batch)
        torch._dynamo.config.enable_aot_compile = True

    def __call__(self, *args):
        leaves = torch.utils._pytree.tree_leaves(args)  # once per call: both uses below read them
        quick = quick_signature(leaves)
        key = self.keys.get(quick)
        if key is None:  # a new shape (or count of documents): the full signature, hashed
            key = self.keys[quick] = hashlib.sha256(call_signature(args).encode()).hexdigest()[:16]
        if key not in self.fns:
            self.fns[key] = self._load_or_compile(key, args)
            if self.fns[key] is not None:
                self.fns[key].disable_guard_check()  # checked below, once per call (it would check them again)
        f = self.fns[key]
        if f is None:
            return self.fallback(*args)
        marks = strip_dim_marks(leaves)
        if not f.guard_check(*args):
            PRECOMPILED.append(("plain", f"precompiled: {self.name} {key}: its guards refuse this call: compiled "
                                         f"as usual", 0, 0))
            self.fns[key] = None
            for x, attr, value in marks:  # the plain compile reads them
                setattr(x, attr, value)
            return self.fallback(*args)
        return f(*args)

    def _load_or_compile(self, key, args):
        path = self.folder / f"{self.name}-{key}.aot"
        t0 = time.perf_counter()
        if path.is_file():
            try:
                with open(path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
                size = path.stat().st_size / 2 ** 20
                PRECOMPILED.append(("loaded", f"precompiled: {self.name} {key}: loaded {size:.1f} MiB in "
                                              f"{time.perf_counter() - t0:.1f} s", 0, 0))
                return fn
            except Exception as e:  # noqa: BLE001 (any failure: this graph compiles)
                not_loaded = f"{path} did not load ({_first_line(e)}), "
        else:
            not_loaded = ""
        from torch._dynamo.utils import counters
        before = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        try:
            fn = torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options).aot_compile((args, {}))
            data = type(fn).serialize(fn).serialized_data
        except Exception as e:  # noqa: BLE001
            PRECOMPILED.append(("plain", f"precompiled: {self.name} {key}: {not_loaded}not compiled ahead of time "
                                         f"({_first_line(e)}): compiled as usual", 0, 0))
            return None
        hits = counters["inductor"]["fxgraph_cache_hit"] - before[0]
        lookups = hits + counters["inductor"]["fxgraph_cache_miss"] - before[1]
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # whole or not at all: ranks may write it at once
        tmp.write_bytes(data)
        os.replace(tmp, path)
        PRECOMPILED.append(("compiled", f"precompiled: {self.name} {key}: {not_loaded}compiled and saved "
                                        f"{len(data) / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.1f} s "
                                        f"(fx_graph_cache {hits}/{lookups} hits)", hits, lookups))
        return fn


def _first_line(e):
    """An exception as "Type: first line of its message"."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def strip_dim_marks(leaves):
    """Remove DIM_MARKS from every tensor of ``leaves`` (a call's pytree leaves); returns [(tensor, attribute,
    value)] removed."""
    removed = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            for attr in DIM_MARKS:
                if hasattr(x, attr):
                    removed.append((x, attr, getattr(x, attr)))
                    delattr(x, attr)
    return removed


def copy_cache_tree(src, dst):
    """Copy the cache folder src into dst (merging), skipping what another process compiling into src meanwhile
    removes before it is copied: inductor and Triton write each entry as a temporary file and rename it, so a file
    listed may be gone a moment later; an entry renamed into place after the listing is left out."""
    for root, _, files in os.walk(src):
        out = Path(dst) / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            try:
                shutil.copy2(Path(root) / f, out / f)
            except FileNotFoundError:
                pass


def log_compilation(log, phases, metrics, cache, d, ahead=frozenset()):
    """After the compile warmup: compile_warmup_s (the phases' seconds), how the compile started (the
    compile_cache line: cold, warm, or loaded from --compile-cache) and the compile_report lines of the frames
    ``metrics`` (ahead: compile_report's) and the lines of Precompiled (--compile-cache's whole functions: loaded,
    or compiled and saved; the state reads "precompiled" where every graph loaded whole); then rank 0 copies the
    caches into --compile-cache while the other ranks wait."""
    log(f"compile_warmup_s: {sum(s for _, s in phases):.1f}")
    more = tuple(sum(e[i] for e in PRECOMPILED) for i in (2, 3))
    lines, state = compile_report(metrics, phases, ahead, more)
    loaded = sum(e[0] == "loaded" for e in PRECOMPILED)
    if loaded:
        alone = loaded == len(PRECOMPILED) and not any(x.startswith("compile_report: frame ") for x in lines)
        whole = f"{loaded} whole functions loaded"
        state = f"precompiled ({whole})" if alone else f"{state}; {whole}"
    lines += [e[1] for e in PRECOMPILED]
    PRECOMPILED.clear()
    log(f"compile_cache: {cache.describe(state) if cache is not None else state}")
    for line in lines:
        log(line)
    if cache is not None:
        if d.rank == 0:
            log(cache.save())
        if d.world > 1:
            dist.barrier()


AHEAD_REPORT = "compile_ahead_report: "


def ahead_report(main_s, trainer_s, step_s, report_lines):
    """A second process's last output line (train_gpt.compile_ahead), which AheadProcess.finish reads into the run's
    log: the seconds of its main (to its Trainer, then the step that compiled) and its compile_report frame lines."""
    frames = [x.removeprefix("compile_report: ") for x in report_lines if x.startswith("compile_report: frame ")]
    return AHEAD_REPORT + json.dumps({"main_s": main_s, "trainer_s": trainer_s, "step_s": step_s, "frames": frames})


def ahead_detail(wall, output):
    """What a second process that compiled reported of its time (ahead_report, its output's last such line), as
    the log line's tail: " (start 7.0 s, Trainer 5.1 s, step 64.2 s; frame ...)", where start is its seconds from
    its launch to its main (interpreter, imports: wall, its launch to its end, less its main's); "" where it
    printed no report (or an unreadable one)."""
    for line in reversed(output.splitlines()):
        if line.startswith(AHEAD_REPORT):
            try:
                r = json.loads(line[len(AHEAD_REPORT):])
                times = (f"start {wall - r['main_s']:.1f} s, Trainer {r['trainer_s']:.1f} s, step "
                         f"{r['step_s']:.1f} s")
                return f" ({times}" + "".join(f"; {f}" for f in r["frames"]) + ")"
            except (ValueError, KeyError, TypeError):
                return ""
    return ""


class AheadProcess:
    """A second process compiling ``what`` into the compile caches: ``command`` started at once in ``cwd`` with
    ``spec`` as JSON on its stdin, its output kept in a temporary file, a thread noting when it ends.
    ``finish(timeout)`` waits for it and returns the log's ``compile_ahead:`` line: compiled (when it ended, from its
    start, how long finish waited for it, then what it reported of its seconds: ahead_detail), failed (its exit code
    and last output line), or still running after timeout more seconds, then ended. Where it did not compile, this
    process compiles the graph itself as it would have anyway; the other process's cache entries are written whole
    or not at all."""

    def __init__(self, what, command, spec, cwd):
        self.what, self.t0, self.ok, self.ended = what, time.perf_counter(), False, None
        self.out = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE, stdout=self.out,
                                     stderr=subprocess.STDOUT)
        self.watcher = threading.Thread(target=self._watch, name=f"compile_ahead: {what}", daemon=True)
        self.watcher.start()
        try:
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it ended before reading: finish() reports its exit code and output
            pass

    def _watch(self):
        self.proc.wait()
        self.ended = time.perf_counter()

    def finish(self, timeout):
        asked = time.perf_counter()
        self.watcher.join(timeout)
        if self.watcher.is_alive():
            self.proc.kill()
            self.watcher.join()
            return f"compile_ahead: {self.what}: the second process was still running {timeout:.0f} s later: " \
                   f"ended, compiling here"
        rc, wall = self.proc.returncode, self.ended - self.t0
        self.out.seek(0)
        output = self.out.read().decode(errors="replace")
        if rc == 0:
            self.ok = True
            return (f"compile_ahead: {self.what}: compiled by a second process, done {wall:.1f} s after its start, "
                    f"waited for {max(0.0, self.ended - asked):.1f} s" + ahead_detail(wall, output))
        lines = [x for x in output.splitlines() if x.strip()]
        return (f"compile_ahead: {self.what}: the second process failed (exit code {rc}: "
                f"{lines[-1].strip() if lines else 'no output'}), compiling here")


class Compilation:
    """The compile side of one run (enabled: hp.compile, always off on the CPU). Made before anything compiles:
    opens --compile-cache PATH (rank 0 reads the stamp, and empties a stale cache, before the other ranks look;
    without compilation PATH is logged as unused). ``warmup`` runs and reports the compile warmup;
    ``timed_run_starts`` and ``log_recompiles`` bracket the timed run. d: the run's ranks and device
    (distributed.Dist); log: its Logger; key: what its graphs depend on (train_gpt.graphs_key; None: no
    compiled_mark is read or written)."""

    def __init__(self, enabled, cache_path, d, log, key=None):
        self.enabled, self.d, self.log, self.key = enabled, d, log, key
        self.cache, self.graphs, self.ahead, self.ahead_ok = None, 0, {}, []
        if cache_path and not enabled:
            log(f"compile_cache: --compile-cache {cache_path} not used (nothing is compiled)")
        elif cache_path:
            self.cache = CompileCache(cache_path, CompileCache.current_stamp(d.device))
            if d.rank == 0:
                self.cache.open()
            if d.world > 1:
                dist.barrier()
            if d.rank != 0:
                self.cache.open(owner=False)
        # read after --compile-cache may have pointed inductor at its folder
        self.marked = enabled and key is not None and compiled_mark(key).is_file()

    def precompiled(self):
        """Where this run's whole compiled functions are kept (Precompiled): --compile-cache PATH/aot/KEY where the
        run compiles and has a key, else None."""
        if self.enabled and self.cache is not None and self.key is not None:
            return self.cache.path / "aot" / self.key
        return None

    def compiles_ahead(self):
        """Whether start_ahead starts processes: this run compiles, its caches did not come loaded from
        --compile-cache, and the inductor cache holds no compiled_mark of its graphs (in either case every graph
        is there already)."""
        return self.enabled and not (self.cache is not None and self.cache.loaded) and not self.marked

    def start_ahead(self, what, command, spec, cwd):
        """Start an AheadProcess compiling ``what`` (where compiles_ahead)."""
        if self.compiles_ahead():
            self.ahead[what] = AheadProcess(what, command, spec, cwd)

    def ahead_done(self, what, timeout=AHEAD_WAIT_S):
        """Before compiling ``what`` here: wait for its AheadProcess, if one was started (at most timeout s), and log
        its line."""
        if what in self.ahead:
            process = self.ahead.pop(what)
            self.log(process.finish(timeout))
            if process.ok:
                self.ahead_ok.append(what)

    def warmup(self, run, frames=lambda names: frozenset()):
        """Compile before the clock starts: run() (the warmup, returning [(phase, seconds)]), then its lines
        (log_compilation, with frames(names of the graphs second processes compiled): their compile_report frames).
        Without compilation run is not called (it would only repeat work): compile_warmup_s 0. After the warmup
        rank 0 writes the compiled_mark of the run's key, unless the steps were Precompiled (--compile-cache): their
        compiles ahead of time leave no graph in the FX graph cache, so a later run on this inductor cache without
        --compile-cache would find the mark but not the graphs, and compile them one after another."""
        if not self.enabled:
            self.log("compile_warmup_s: 0.0")
            return
        n_before = len(compile_metrics())
        phases = run()
        log_compilation(self.log, phases, compile_metrics()[n_before:], self.cache, self.d, frames(self.ahead_ok))
        if self.key is not None and self.d.rank == 0 and self.precompiled() is None:
            mark = compiled_mark(self.key)
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()

    def timed_run_starts(self):
        self.graphs = unique_graphs()

    def log_recompiles(self):
        """With compilation: the graphs compiled since timed_run_starts (shapes or guards that changed)."""
        if self.enabled:
            extra = unique_graphs() - self.graphs
            self.log(f"recompiles_during_timed_run: {extra}" + ("  WARNING: shapes or guards changed after warmup"
                                                                  if extra else ""))
