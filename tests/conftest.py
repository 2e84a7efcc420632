"""Test setup shared by every test module.

Without a GPU the Triton kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be in the
environment before any ``@triton.jit`` function is defined, i.e. before a ``kernels`` module is imported.
pytest imports this file before it collects the test modules, so setting it here is early enough. The
interpreter's repeated swapping of triton.language at every helper call is skipped here
(``_skip_the_interpreters_repeated_patching``; tests/test_interpreter_patching.py shows it changes no bit).

Parallel runs (pytest-xdist; ``pytest.ini`` asks for ``-n auto --dist loadgroup``): ``-n auto`` is decided by
``pytest_xdist_auto_num_workers`` below (``-n 0`` runs in one process, e.g. for a single test). Tests that share a
module-scoped fixture (a smoke run, a checkpoint) carry one ``xdist_group`` mark so that one worker builds it once;
xdist schedules those groups first (largest first), then the other tests in collection order, where
``pytest_collection_modifyitems`` below puts the tests marked ``runs_long`` first (a long test started last would
end the run alone). (pytest >= 9.2 moved the node id that xdist 3.8 renames to mark a group; the same hook renames
it there.) What must be built once per session whatever the scheduling, the compiled GPU runs, goes through
``shared_build`` (a file lock in the session's temporary folder, which all workers share). Every test writes under
its own ``tmp_path`` and torchrun picks a free port (``--standalone``), so workers share no other files and no
ports. Each worker gets an equal share of the CPU threads (torch's intra-op pool, its subprocesses' too, and
inductor's compile workers), and on a GPU hands its cached blocks back after a test that left much cached, so that
the workers share the GPU's memory.
"""
import fcntl
import gc
import os
import shutil
import sys
from pathlib import Path

import pytest

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by xdist in its workers
_THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    # before torch: inductor reads its compile-worker count when it is first imported; the OpenMP pool's size
    # also goes to the tests' subprocesses (a trainer run started by a test), which would otherwise each start
    # one thread per core and, beside the other workers, spin for the cores (a Ctrl-C test took 41 s, not 16)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(_THREADS))
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
# Several GPUs: xdist worker gwN takes GPU N mod their number (the controller lists them in TEST_GPUS before it
# starts the workers), set before torch so that CUDA sees one card; the tests' own subprocesses inherit it.
_GPUS = [g for g in os.environ.get("TEST_GPUS", "").split(",") if g]
if _GPUS and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = _GPUS[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_GPUS)]

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA and not os.environ.get("PYTEST_XDIST_WORKER") and "TEST_GPUS" not in os.environ:
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    os.environ["TEST_GPUS"] = ",".join(visible or map(str, range(torch.cuda.device_count())))
    _GPUS = os.environ["TEST_GPUS"].split(",")
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_the_interpreters_repeated_patching():
    """Triton's interpreter (3.9) swaps triton.language's builtins for interpreted ones at each kernel launch
    (``_patch_lang``: every builtin of tl, tl.tensor and tl.math, found by ``inspect.getmembers``) and restores
    them at the launch's end; it swaps them again at every call of a ``@triton.jit`` helper inside the kernel
    (ours, and Triton's own such as tl.cdiv and tl.zeros, whose module holds triton.language.core), where that
    changes nothing once the launch, or an earlier helper call in it, swapped the language modules the helper's
    globals hold: their builtins are swapped already, and what it sets besides (range, static_assert, reduce, ...)
    are the same functions again. A helper called per tile and program makes that repetition the largest cost of
    an interpreted kernel test. Here such a helper call skips it; the first call of a helper that sees another
    language module, one that sees none (Triton's error) and a call outside a launch run Triton's code as before.
    The builtins a launch swaps are looked up once per module, not by getmembers at each launch, and the numpy
    dtype of a Triton type (``_get_np_dtype``, which builds a dict of every type at each of its calls, several per
    interpreted operation) once per type. Nothing else changes: tests/test_interpreter_patching.py runs kernels
    both ways and compares. Returns the counts of helper calls inside launches skipped and left to Triton (None
    where Triton's interpreter is another)."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as ti
        patch_lang, patch_builtin, patch_attr, np_dtype = ti._patch_lang, ti._patch_builtin, ti._patch_attr, \
            ti._get_np_dtype
    except (ImportError, AttributeError):  # another Triton: its interpreter as it is
        return None
    if hasattr(patch_lang, "triton"):  # installed by this file imported under another name (tests.conftest)
        return patch_lang.counts
    launch = {"langs": None}  # the language modules the launch in progress swapped (None: no launch)
    counts = {"skipped": 0, "triton": 0}  # helper calls inside launches: skipped, and left to Triton
    langs_of, members_of = {}, {}

    class Unchanged:
        def restore(self):
            pass

    def langs(fn):  # as _patch_lang finds them
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    def fast_patch_lang(fn):
        if launch["langs"] is not None:  # a helper called inside a launch
            if langs(fn) and langs(fn) <= launch["langs"]:
                counts["skipped"] += 1
                return Unchanged()
            counts["triton"] += 1
            scope = patch_lang(fn)  # never restored (Triton drops it): swapped for the rest of the launch too
            launch["langs"] |= langs(fn)
            return scope
        scope = patch_lang(fn)  # a launch (GridExecutor.__call__ restores the scope in a finally)
        launch["langs"] = langs(fn)
        restore = scope.restore

        def restore_and_end():
            launch["langs"] = None
            restore()
        scope.restore = restore_and_end
        return scope

    def fast_patch_builtin(pkg, builder, scope):
        members = members_of.get(pkg)
        if members is None or any(getattr(pkg, name, None) is not m for name, m in members):
            if launch["langs"] is not None:  # pkg may hold swapped members now: Triton's own lookup
                return patch_builtin(pkg, builder, scope)
            members = members_of[pkg] = [(name, m) for name, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, m in members:
            patch_attr(pkg, name, m, builder, scope)

    np_dtypes = {}

    def fast_np_dtype(tt):  # a block's is its element's; pointers (unhashable) are Triton's to answer
        if isinstance(tt, tl.block_type):
            tt = tt.element_ty
        if isinstance(tt, tl.pointer_type):
            return np_dtype(tt)
        if tt not in np_dtypes:
            np_dtypes[tt] = np_dtype(tt)
        return np_dtypes[tt]

    # Triton's own, for the test
    fast_patch_lang.triton, fast_patch_builtin.triton, fast_np_dtype.triton = patch_lang, patch_builtin, np_dtype
    fast_patch_lang.counts = counts
    ti._patch_lang, ti._patch_builtin, ti._get_np_dtype = fast_patch_lang, fast_patch_builtin, fast_np_dtype
    return counts


INTERPRETER_SHORTCUT = None
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
    INTERPRETER_SHORTCUT = _skip_the_interpreters_repeated_patching()
if _WORKERS > 1:
    torch.set_num_threads(_THREADS)

DEVICE = "cuda" if HAS_CUDA else "cpu"
# A worker keeps at most this much GPU memory cached between tests (the speedrun-shape tests cache up to ~20 GB).
_CACHED_LIMIT = 4 << 30


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: on a GPU machine at most 8 workers per GPU and 2 CPU cores each (Triton and inductor compile on
    the CPU; the tests' float64 references run there too); on a CPU-only machine one worker per core, one thread
    each (CI's 2 cores: the interpreted kernels and the small CPU models keep about one thread busy; one process
    with two threads ran test_cross_entropy.py in 99 s, two workers in 62 s), one process on a single core.
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = os.cpu_count() or 1
    if HAS_CUDA:
        return max(1, min(8 * max(1, len(_GPUS)), cpus // 2))
    return cpus if cpus >= 2 else 0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests marked ``runs_long`` first (otherwise in collection order), so that xdist starts them early.
    Under ``--dist loadgroup`` on pytest >= 9.2, where a node id is ``str(item._id)`` and xdist 3.8's renaming
    of ``item._nodeid`` to ``<node id>@<group>`` does nothing, the same renaming of ``item._id`` (every worker
    collects and renames alike; the controller groups the tests by that suffix)."""
    items.sort(key=lambda item: item.get_closest_marker("runs_long") is None)
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        node_id = getattr(item, "_id", None)
        if names and not item.nodeid.endswith(suffix) and hasattr(type(node_id), "parse"):
            item._id = type(node_id).parse(item.nodeid + suffix)


def pytest_report_header(config):
    mode = f"GPU ({torch.cuda.get_device_name()})" if HAS_CUDA else "CPU, TRITON_INTERPRET=1"
    return f"kernels run on: {mode}; torch {torch.__version__}"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _same_global_rng_for_every_test():
    """Every test starts from the same state of torch's global generator (seed 0), whatever ran before it in its
    process: tests that draw inputs without a generator of their own then see the same numbers in one process and
    under xdist, where a worker runs tests in an order that changes from run to run. (On 2026-11-25 a GPU run in
    parallel gave one cross-entropy test inputs it had never seen in the fixed order of one process.)"""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _hand_back_cached_gpu_memory():
    yield
    if HAS_CUDA and torch.cuda.memory_reserved() > _CACHED_LIMIT:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def script_main(monkeypatch):
    """``script_main(module, argv)`` runs the ``if __name__ == "__main__":`` block of an imported script module
    (train_gpt, data/hellaswag.py, ...) in this process, with ``sys.argv = [<script file name>, *argv]``: what
    ``python <script> argv`` runs after its imports, the error handling included. Returns the exit code (0 if the
    block returns); an exception the block lets through propagates (in a subprocess: a traceback). Output goes to
    capsys. For tests of the command line where the process boundary itself is not what is tested."""
    import ast

    def run(module, argv):
        path = Path(module.__file__)
        tree = ast.parse(path.read_text(), filename=str(path))
        blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Compare)
                  and isinstance(n.test.left, ast.Name) and n.test.left.id == "__name__"]
        assert len(blocks) == 1, f"{path.name}: expected one `if __name__ == '__main__':` block"
        code = compile(ast.Module(body=blocks[0].body, type_ignores=[]), str(path), "exec")
        monkeypatch.setattr(sys, "argv", [path.name, *map(str, argv)])
        try:
            exec(code, {**vars(module), "__name__": "__main__"})
        except SystemExit as e:
            return 0 if e.code is None else e.code
        return 0

    return run


@pytest.fixture(scope="session")
def shared_build(tmp_path_factory):
    """``shared_build(name, build)``: the folder ``build(folder)`` filled, built once per test session and shared by
    all xdist workers (the first to ask builds it under a file lock while the others wait, then they all read it).
    A build that raised is tried again by the next test that asks (and fails it the same way)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # xdist: each worker's basetemp is a folder of the session's

    def get(name, build):
        out = root / f"shared_{name}"
        with open(root / f"shared_{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not (out / ".built").exists():
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    build(out)
                    (out / ".built").write_text("")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return out

    return get
