"""Tests of compilation.py: --compile-cache (save, load, a stale or unstamped cache, a path that is a file), the
compile report's lines and cache states, a run's Compilation without compilation, the second processes
(AheadProcess: spec, report, failure, timeout), the compiled mark and inductor's cache folder. A smoke run with
--compile-cache and no compilation is tested in test_train_gpt.py."""
import getpass
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import torch

import compilation
from compilation import Compilation, CompileCache, compile_report, inductor_cache_dir, triton_cache_dir


def _stamp(**over):
    return {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3", "gpu": "NVIDIA H200",
            "code": "0123456789abcdef", **over}


@pytest.fixture
def compiler_caches(tmp_path, monkeypatch):
    """Inductor's and Triton's cache folders, each holding one artefact, as the environment names them."""
    ind, tri = tmp_path / "inductor_default", tmp_path / "triton_default"
    for d, name in ((ind, "graph.py"), (tri, "kernel.cubin")):
        d.mkdir()
        (d / name).write_bytes(b"x" * 1000)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ind))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tri))
    return ind, tri


def test_compile_cache_saves_then_loads(tmp_path, compiler_caches, monkeypatch):
    """An empty PATH compiles (and says so); save() copies both caches and writes the stamp; a later process with
    the same stamp loads: inductor and Triton are pointed at PATH before anything compiles."""
    path = tmp_path / "cc"
    first = CompileCache(path, _stamp()).open()
    assert not first.loaded and first.describe("cold") == f"cold (--compile-cache {path}: empty: compiling)"
    line = first.save()
    assert line.startswith(f"compile_cache_saved: {path} ") and line.endswith(" s")
    assert (path / "inductor" / "graph.py").is_file() and (path / "triton" / "kernel.cubin").is_file()
    assert json.loads((path / "stamp.json").read_text()) == _stamp()
    second = CompileCache(path, _stamp()).open()
    assert second.loaded and second.describe("warm") == f"loaded {path} (warm)"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton")
    assert inductor_cache_dir() == path / "inductor" and triton_cache_dir() == path / "triton"


@pytest.mark.parametrize("field", ["torch", "triton", "gpu", "code"])
def test_compile_cache_with_another_version_is_emptied_with_one_reason(tmp_path, compiler_caches, field):
    path = tmp_path / "cc"
    CompileCache(path, _stamp()).open().save()
    cache = CompileCache(path, _stamp(**{field: "other"})).open()
    assert not cache.loaded
    text = cache.describe("cold")
    assert "\n" not in text and f"made with {field} {_stamp()[field]}" in text and f"{field} other" in text
    assert "emptied, compiling" in text
    assert not (path / "inductor").exists() and not (path / "triton").exists() and not (path / "stamp.json").exists()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] != str(path / "inductor")  # the run compiles where it would anyway


def test_compile_cache_without_a_stamp_is_not_trusted(tmp_path, compiler_caches):
    path = tmp_path / "cc"
    (path / "inductor").mkdir(parents=True)
    cache = CompileCache(path, _stamp()).open()
    assert not cache.loaded and "no stamp.json" in cache.describe("cold")


def test_compile_cache_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("")
    with pytest.raises(FileNotFoundError, match="--compile-cache .*not_a_dir: exists and is not a directory"):
        CompileCache(target, _stamp()).open()  # main() prints it as one line, exit code 2


def test_compile_cache_keeps_whole_functions_only_under_its_stamp(tmp_path, compiler_caches):
    """PATH/aot (Precompiled's files) stays where the stamp matches; a stale stamp empties it with the rest; an
    unstamped PATH (an interrupted save) loses it on the owner's (rank 0's) open, not on another rank's."""
    path = tmp_path / "cc"

    def whole():
        (path / "aot" / "k").mkdir(parents=True, exist_ok=True)
        (path / "aot" / "k" / "train_step-0123.aot").write_bytes(b"x")
        return path / "aot" / "k" / "train_step-0123.aot"

    CompileCache(path, _stamp()).open().save()
    f = whole()
    assert CompileCache(path, _stamp()).open().loaded and f.is_file()
    assert not CompileCache(path, _stamp(code="other")).open().loaded and not (path / "aot").exists()
    (path / "stamp.json").unlink(missing_ok=True)
    f = whole()
    assert not CompileCache(path, _stamp()).open(owner=False).loaded and f.is_file()
    assert not CompileCache(path, _stamp()).open().loaded and not (path / "aot").exists()


def test_compilation_keeps_whole_functions_per_graphs_key(tmp_path, compiler_caches):
    """Compilation.precompiled: PATH/aot/KEY where the run compiles, has --compile-cache and a graphs key; None
    otherwise (the steps are then plain torch.compile, or not compiled)."""
    d = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    path = tmp_path / "cc"
    assert Compilation(True, str(path), d, [].append, "k1").precompiled() == path / "aot" / "k1"
    assert Compilation(True, None, d, [].append, "k1").precompiled() is None
    assert Compilation(True, str(path), d, [].append).precompiled() is None
    assert Compilation(False, str(path), d, [].append, "k1").precompiled() is None


def test_log_compilation_reports_whole_functions(compiler_caches, monkeypatch):
    """log_compilation logs Precompiled's lines after compile_report's and forgets them; where every graph came
    loaded whole (no frame compiled) the state is "precompiled (n whole functions loaded)", beside compiled frames
    it is the frames' state with the count added; their FX-graph cache counts join the frames'."""
    d = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    monkeypatch.setattr(compilation, "unique_graphs", lambda: 0)
    lines = []
    compilation.PRECOMPILED[:] = [("loaded", "precompiled: train_step 0123: loaded 9.0 MiB in 1.0 s", 0, 0),
                                  ("loaded", "precompiled: val_step 4567: loaded 4.0 MiB in 0.5 s", 0, 0)]
    compilation.log_compilation(lines.append, [("stage0", 5.0)], [], None, d)
    assert lines[1] == "compile_cache: precompiled (2 whole functions loaded)", lines
    assert lines[-2:] == ["precompiled: train_step 0123: loaded 9.0 MiB in 1.0 s",
                          "precompiled: val_step 4567: loaded 4.0 MiB in 0.5 s"] and compilation.PRECOMPILED == []
    lines.clear()
    compilation.PRECOMPILED[:] = [("loaded", "precompiled: train_step 0123: loaded 9.0 MiB in 1.0 s", 0, 0),
                                  ("compiled", "precompiled: train_step 89ab: compiled and saved ...", 2, 2)]
    compilation.log_compilation(lines.append, [("stage0", 5.0)], [], None, d)
    assert lines[1] == "compile_cache: warm; 1 whole functions loaded", lines
    lines.clear()
    compilation.PRECOMPILED[:] = [("plain", "precompiled: val_step 4567: its guards refuse ...", 0, 0)]
    compilation.log_compilation(lines.append, [("stage0", 5.0)], [], None, d)
    assert lines[1] == "compile_cache: cold" and lines[-1] == "precompiled: val_step 4567: its guards refuse ..."


def test_compile_report_states_and_lines():
    """The cache state from the FX-graph cache counts (cold / warm / partly warm), one line per frame with its
    phases and both caches' hits, and a total; entries without a code object (runtime events) are left out."""
    M = types.SimpleNamespace

    def frame(cid, hit, miss, aot_hit=0, aot_miss=1):
        return M(compile_id=cid, co_name="train_step", is_forward=True, entire_frame_compile_time_s=50.0,
                 aot_autograd_cumulative_compile_time_us=40e6, inductor_cumulative_compile_time_us=30e6,
                 triton_compile_time_us=5e6, graph_op_count=1109, inductor_fx_local_cache_hit_count=hit,
                 inductor_fx_local_cache_miss_count=miss, aotautograd_local_cache_hit_count=aot_hit,
                 aotautograd_local_cache_miss_count=aot_miss)

    runtime = M(compile_id="0/0", co_name=None, is_forward=True, entire_frame_compile_time_s=None)
    phases = [("stage0", 60.0), ("validation", 10.0)]
    lines, state = compile_report([frame("0/0", 0, 2), runtime], phases)
    assert state == "cold" and len(lines) == 2
    assert lines[0] == ("compile_report: frame train_step [0/0] ops 1109: 50.0 s (dynamo 10.0, aot_autograd 10.0, "
                        "inductor 30.0 of which triton 5.0), lazily compiled backward 0.0 s (triton 0.0); "
                        "fx_graph_cache 0/2 hits; aot_autograd_cache 0/1 hits")
    # the AOT-autograd counts of the frame and of its lazily compiled backward add up; a torch without the fields
    # (an older CompilationMetrics) reads 0/0
    back = M(compile_id="0/0", co_name=None, is_forward=False, backward_cumulative_compile_time_us=0,
             triton_compile_time_us=0, aotautograd_local_cache_hit_count=2, aotautograd_local_cache_miss_count=1)
    assert compile_report([frame("0/0", 1, 1, 1, 0), back], phases)[0][0].endswith(
        "fx_graph_cache 1/2 hits; aot_autograd_cache 3/4 hits")
    bare = M(compile_id="1/0", co_name="val_step", is_forward=True, entire_frame_compile_time_s=1.0)
    assert compile_report([bare], phases)[0][0].endswith("fx_graph_cache 0/0 hits; aot_autograd_cache 0/0 hits")
    assert lines[1].startswith("compile_report: 1 frames compiled, ")
    assert "compile 50.0 s of the warmup's 70.0 s" in lines[1]
    assert compile_report([frame("0/0", 2, 0)], phases)[1] == "warm"
    assert compile_report([frame("0/0", 2, 0), frame("0/1", 0, 2)], phases)[1] == \
        "partly warm (2 of 4 graphs from the cache)"
    # frames a second process compiled (hits that say nothing of the caches at the start) are named and left out
    fresh = [frame("0/0", 0, 2), frame("0/1", 2, 0), frame("0/2", 2, 0)]
    assert compile_report(fresh, phases)[1] == "partly warm (4 of 6 graphs from the cache)"
    lines, state = compile_report(fresh, phases, frozenset({"train_step [0/1]", "train_step [0/2]"}))
    assert state == "cold"
    assert [line.endswith("; compiled by a second process") for line in lines[:3]] == [False, True, True]
    assert compile_report([frame("0/0", 2, 0), frame("0/1", 2, 0)], phases, frozenset({"train_step [0/1]"}))[1] \
        == "warm"


def test_compilation_without_compiling_runs_no_warmup(tmp_path):
    """hp.compile off (the CPU): --compile-cache is logged as unused and left alone, the warmup is not run (one
    `compile_warmup_s: 0.0` line) and there is no recompile line."""
    lines = []
    d = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    comp = Compilation(False, str(tmp_path / "cc"), d, lines.append)
    comp.warmup(lambda: pytest.fail("the warmup ran without compilation"))
    comp.timed_run_starts()
    comp.log_recompiles()
    assert lines == [f"compile_cache: --compile-cache {tmp_path / 'cc'} not used (nothing is compiled)",
                     "compile_warmup_s: 0.0"]
    assert comp.cache is None and not (tmp_path / "cc").exists()
    Compilation(False, None, d, lines.append)
    assert len(lines) == 2, "no --compile-cache: nothing to say"


def test_int_array_names_are_keyed_by_the_buffer_they_were_written_to(monkeypatch):
    """The backport (torch 2.11's C++ wrapper): an array declared through one buffer's writeline is named again
    only for that buffer, however many bound-method objects reach it, and one declared inside another buffer (a
    custom op's scope) gets a name of its own in the first; where torch keys on the buffer itself, nothing is
    installed."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    monkeypatch.setattr(CppWrapperCpu, "codegen_int_array_var", CppWrapperCpu.codegen_int_array_var)
    if compilation.int_arrays_keyed_by_their_buffer():  # torch 2.11: installed once; the second call finds it
        assert not compilation.int_arrays_keyed_by_their_buffer()
    else:  # torch 2.13: its own fix; install the backport over a copy of 2.11's key to exercise it
        def by_method_id(self, int_array, writeline, known_statically=False, graph=None):
            return "2.11 keys on id(writeline)"
        monkeypatch.setattr(CppWrapperCpu, "codegen_int_array_var", by_method_id)
        monkeypatch.setattr(compilation.inspect, "getsource", lambda obj: "id(writeline)")
        assert compilation.int_arrays_keyed_by_their_buffer()

    class Buffer:
        def __init__(self):
            self.lines = []

        def writeline(self, line):
            self.lines.append(line)

    declared = []

    class Wrapper:
        codegen_int_array_var = CppWrapperCpu.codegen_int_array_var

        def _codegen_int_array_var_impl(self, int_array, writeline, known_statically):
            var = f"int_array_{len(declared)}"
            declared.append(var)
            writeline(f"const int64_t {var}[] = {int_array};")
            return var

    w, top = Wrapper(), Buffer()
    first = w.codegen_int_array_var("{768L, 1L}", top.writeline)
    scope = Buffer()
    in_scope = w.codegen_int_array_var("{3072L, 1L}", scope.writeline)
    del scope  # its bound method's id (and the buffer's) may now be reused
    assert w.codegen_int_array_var("{768L, 1L}", top.writeline) == first
    again = w.codegen_int_array_var("{3072L, 1L}", top.writeline)
    assert again != in_scope and again in "".join(top.lines), "a scoped declaration named at the top level"
    assert w.codegen_int_array_var("{768L, 1L}", top.writeline, graph=object()) != first


def _ahead(tmp_path, code, spec=None):
    """An AheadProcess running `code` in Python, its spec {"x": 1} unless given."""
    return compilation.AheadProcess("the graph", [sys.executable, "-c", code], spec or {"x": 1}, str(tmp_path))


# AheadProcess.finish's line for a process that compiled: when it ended (from its start), how long finish waited
DONE = (r"compile_ahead: the graph: compiled by a second process, done (\d+\.\d) s after its start, waited for "
        r"(\d+\.\d) s")


def test_ahead_process_gets_its_spec_on_stdin_in_its_folder_and_reports_done(tmp_path):
    """The command runs in cwd with the spec as JSON on its stdin; finish() waits for it and says it compiled."""
    ahead = _ahead(tmp_path, "import json, sys, pathlib; pathlib.Path('got.json').write_text(sys.stdin.read())",
                   {"hp": {"seed": 3}, "files": ["a", "b"]})
    line = ahead.finish(60)
    assert re.fullmatch(DONE, line), line
    assert json.loads((tmp_path / "got.json").read_text()) == {"hp": {"seed": 3}, "files": ["a", "b"]}


def test_ahead_process_done_is_when_it_ended_not_when_it_was_asked_for(tmp_path):
    """"done" counts to the process's end, however late finish() comes, and "waited for" is how long finish()
    waited: 0 for a process that ended before it was asked for, its remaining time for one still running."""
    early = _ahead(tmp_path, "pass")
    time.sleep(4.0)
    m = re.fullmatch(DONE, early.finish(60))
    assert m and float(m[1]) < 3.0 and float(m[2]) == 0.0, m
    late = _ahead(tmp_path, "import time; time.sleep(3.0)")
    m = re.fullmatch(DONE, late.finish(60))
    assert m and 3.0 <= float(m[1]) and 2.0 <= float(m[2]) <= float(m[1]), m


def test_ahead_process_that_compiled_adds_what_it_reported_of_its_time(tmp_path):
    """A second process's last report line (ahead_report: its main's seconds, its Trainer's, its step's, and its
    compile_report frame lines) becomes the log line's tail: the seconds before its main are the wall time less its
    main's; other compile_report lines (the total) are left out; output after it and a report that is no JSON
    object of those keys give the plain line."""
    report = compilation.ahead_report(0.5, 0.1, 0.3, [
        "compile_report: frame val_step [0/0] ops 12: 1.2 s (dynamo 0.2, aot_autograd 0.3, inductor 0.7 of which "
        "triton 0.1), lazily compiled backward 0.0 s (triton 0.0); fx_graph_cache 0/1 hits; aot_autograd_cache 0/1 "
        "hits", "compile_report: 1 frames compiled, 1 graphs, compile 1.2 s of the warmup's 0.0 s (the rest: ...)"])
    code = f"import time; time.sleep(2.0); print('compile_ahead: validation: loss 1.0'); print({report!r})"
    line = _ahead(tmp_path, code).finish(60)
    m = re.fullmatch(DONE + r" \(start (\d+\.\d) s, Trainer 0\.1 s, step 0\.3 s; frame val_step \[0/0\] ops 12: 1\.2 s "
                     r"\(dynamo 0\.2, aot_autograd 0\.3, inductor 0\.7 of which triton 0\.1\), lazily compiled "
                     r"backward 0\.0 s \(triton 0\.0\); fx_graph_cache 0/1 hits; aot_autograd_cache 0/1 hits\)", line)
    assert m, line
    assert float(m[1]) >= 2.0 and abs(float(m[3]) - (float(m[1]) - 0.5)) <= 0.11, line
    for tail in ("compile_ahead_report: not json", 'compile_ahead_report: {"main_s": 1}', "compile_ahead_report: [1]"):
        plain = _ahead(tmp_path, f"print({tail!r})").finish(60)
        assert re.fullmatch(DONE, plain), (tail, plain)


def test_ahead_process_that_fails_is_reported_with_its_exit_code_and_last_line(tmp_path):
    """A failure is one line: exit code and the last non-empty line it printed (stdout or stderr); a process that
    ends before reading its stdin is reported the same way."""
    code = "import sys; print('loading'); print('RuntimeError: CUDA out of memory', file=sys.stderr); sys.exit(3)"
    assert _ahead(tmp_path, code).finish(60) == ("compile_ahead: the graph: the second process failed (exit code 3: "
                                                "RuntimeError: CUDA out of memory), compiling here")
    silent = _ahead(tmp_path, "import os; os._exit(1)", {"big": "x" * 10 ** 6})  # a full pipe, nobody reading
    assert silent.finish(60) == ("compile_ahead: the graph: the second process failed (exit code 1: no output), "
                                 "compiling here")


def test_ahead_process_still_running_at_the_timeout_is_ended(tmp_path):
    ahead = _ahead(tmp_path, "import time; time.sleep(60)")
    t0 = time.perf_counter()
    line = ahead.finish(0.5)
    assert time.perf_counter() - t0 < 20
    assert line == ("compile_ahead: the graph: the second process was still running 0 s later: ended, compiling "
                    "here")
    assert ahead.proc.poll() is not None, "the process was left running"


def test_compilation_starts_ahead_processes_only_where_it_compiles_graphs(tmp_path, compiler_caches):
    """start_ahead starts nothing without compilation or with caches loaded from --compile-cache (every graph is
    there); otherwise one process per graph, and ahead_done(name) waits for that one and logs its line once (a name
    without a process: nothing); ahead_ok lists those that compiled (compile_report leaves their frames out)."""
    d = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    cmd = ([sys.executable, "-c", "import sys; sys.stdin.read()"], {}, str(tmp_path))
    lines = []
    off = Compilation(False, None, d, lines.append)
    assert not off.compiles_ahead()
    off.start_ahead("validation step", *cmd)
    off.ahead_done("validation step")
    assert off.ahead == {} and lines == []
    CompileCache(tmp_path / "cc", CompileCache.current_stamp(d.device)).open().save()
    loaded = Compilation(True, str(tmp_path / "cc"), d, lines.append)
    assert loaded.cache.loaded and not loaded.compiles_ahead()
    loaded.start_ahead("validation step", *cmd)
    assert loaded.ahead == {}
    on = Compilation(True, None, d, lines.append)
    assert on.compiles_ahead()
    on.start_ahead("training step T=256", [sys.executable, "-c", "import sys; sys.exit(4)"], {}, str(tmp_path))
    on.start_ahead("validation step", *cmd)
    assert set(on.ahead) == {"training step T=256", "validation step"}
    on.ahead_done("training step T=128")
    assert lines == []
    on.ahead_done("validation step")
    on.ahead_done("validation step")
    assert len(lines) == 1 and lines[0].startswith("compile_ahead: validation step: compiled by a second process")
    on.ahead_done("training step T=256")
    assert lines[1] == ("compile_ahead: training step T=256: the second process failed (exit code 4: no output), "
                        "compiling here")
    assert on.ahead == {} and on.ahead_ok == ["validation step"], "only a graph compiled there is the process's"


def test_a_finished_warmup_marks_its_graphs_and_the_next_run_of_them_starts_no_second_processes(
        tmp_path, compiler_caches):
    """Compilation.warmup, on rank 0 once run() returned, writes a mark for its key in the inductor cache
    (TORCHINDUCTOR_CACHE_DIR): a later Compilation of that key there is ``marked`` and compiles nothing ahead; another
    key, another inductor cache, no key, no compilation, another rank or a warmup that raised leave or write no
    mark; nor does a run with --compile-cache (its steps Precompiled: no graph of theirs is in the FX graph cache)."""
    ind, _ = compiler_caches
    d = types.SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    marks = lambda: sorted(str(p.relative_to(ind)) for p in ind.rglob("*") if p.is_file() and p.name != "graph.py")
    first = Compilation(True, None, d, [].append, "k1")
    assert not first.marked and first.compiles_ahead()
    with pytest.raises(RuntimeError):
        first.warmup(lambda: (_ for _ in ()).throw(RuntimeError("compile failed")))
    Compilation(True, None, types.SimpleNamespace(rank=1, world=2, device=d.device), [].append, "k1").warmup(
        lambda: [])
    Compilation(False, None, d, [].append, "k1").warmup(lambda: [])
    Compilation(True, None, d, [].append).warmup(lambda: [])
    filling = Compilation(True, str(tmp_path / "cc"), d, [].append, "k1")
    assert filling.precompiled() is not None
    filling.warmup(lambda: [("stage0", 1.0)])
    assert marks() == [] and Compilation(True, None, d, [].append, "k1").compiles_ahead()
    first.warmup(lambda: [("stage0", 1.0)])
    assert marks() == ["train_gpt_compiled/k1"]
    again = Compilation(True, None, d, [].append, "k1")
    assert again.marked and not again.compiles_ahead()
    assert Compilation(True, None, d, [].append, "k2").compiles_ahead()
    assert not Compilation(False, None, d, [].append, "k1").marked
    other = tmp_path / "other_inductor"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TORCHINDUCTOR_CACHE_DIR", str(other))
        assert Compilation(True, None, d, [].append, "k1").compiles_ahead()


@pytest.mark.parametrize("env", [None, "relative/inductor"])
def test_inductor_cache_dir_is_torchs_without_importing_inductor(tmp_path, env):
    """inductor_cache_dir(), called before torch._inductor is imported, leaves it unimported and gives the folder
    torch's cache_dir() gives (imported afterwards, by name): TORCHINDUCTOR_CACHE_DIR (from the working folder), or
    without it torchinductor_<user> in the temporary folder; the same once torch._inductor is imported."""
    code = ("import sys, compilation; first = compilation.inductor_cache_dir(); "
            "assert 'torch._inductor' not in sys.modules, 'imported'; "
            "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
            "print(first, cache_dir(), compilation.inductor_cache_dir(), sep='|')")
    env_vars = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if env is not None:
        env_vars["TORCHINDUCTOR_CACHE_DIR"] = env
    env_vars["TMPDIR"] = str(tmp_path / "tmp")
    env_vars["PYTHONPATH"] = str(Path(compilation.__file__).parent)
    (tmp_path / "tmp").mkdir()
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env_vars, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    first, torchs, after = res.stdout.strip().split("|")
    user = getpass.getuser()
    expected = tmp_path / env if env is not None else tmp_path / "tmp" / f"torchinductor_{user}"
    assert first == torchs == after  # torch 2.13 makes the folder absolute, 2.11 keeps it as the variable gives it
    assert (tmp_path / first).resolve() == expected.resolve() and expected.is_dir()


def test_copy_cache_tree_merges_and_skips_files_removed_while_it_copies(tmp_path, monkeypatch):
    """copy_cache_tree copies every file of nested folders into dst (keeping what dst holds), and a file that
    another process removes between the listing and its copy (an entry's temporary file, renamed) is skipped
    instead of failing the save; shutil.copytree would raise there."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    for rel, data in (("a/graph.py", b"g"), ("a/b/kernel.cubin", b"k" * 100), ("top.json", b"{}"),
                      ("a/.1.2.tmp", b"partial")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (dst / "a").mkdir(parents=True)
    (dst / "a" / "old.py").write_bytes(b"o")
    real_copy = shutil.copy2

    def racing_copy(s, d, **kw):
        if Path(s).name == ".1.2.tmp":  # renamed away by its writer just now
            Path(s).unlink()
        return real_copy(s, d, **kw)
    monkeypatch.setattr(shutil, "copy2", racing_copy)
    with pytest.raises(shutil.Error):
        shutil.copytree(src, tmp_path / "with_copytree", copy_function=racing_copy)
    (src / "a" / ".1.2.tmp").write_bytes(b"partial")
    compilation.copy_cache_tree(src, dst)
    got = {str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert got == {"a/graph.py": b"g", "a/b/kernel.cubin": b"k" * 100, "top.json": b"{}", "a/old.py": b"o"}


# ------------------------------------------------------------------------------------------ Precompiled
# A two-layer step in the shape of train_step's call: a dict of parameters, token rows x (T, C) and document bounds
# cu whose length is marked dynamic (any count of documents, one graph). The test's process never compiles: each
# phase is a fresh interpreter, as a run and a later run are. The step runs on the GPU where there is one (inductor's
# Triton code, as in a run), else on the CPU (inductor's C++: each phase builds its kernels, slow where many
# processes share the cores).
PRECOMPILED_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import compilation
folder, phase = sys.argv[2], sys.argv[3]
dev = "cuda" if torch.cuda.is_available() else "cpu"

def step(p, x, cu):
    h = torch.relu(x @ p["w1"]) ** 2
    docs = (cu[1:] - cu[:-1]).float()
    return (h @ p["w2"]).square().mean() * p["s"] + (docs * docs).mean() / x.shape[0]

def inputs(T, cuts):
    g = torch.Generator().manual_seed(T)
    p = {"w1": torch.randn(16, 24, generator=g), "w2": torch.randn(24, 8, generator=g) / 5,
         "s": torch.tensor(0.75)}
    p = {k: v.to(dev).requires_grad_() for k, v in p.items()}
    cu = torch.tensor([0, *cuts, T], dtype=torch.int32, device=dev)
    torch._dynamo.mark_dynamic(cu, 0)
    return p, torch.randn(T, 16, generator=g).to(dev), cu

def run(f, T, cuts):
    p, x, cu = inputs(T, cuts)
    loss = f(p, x, cu)
    loss.backward()
    return [loss.item()] + [p[k].grad.flatten().tolist() for k in sorted(p)]

calls = [(8, [3]), (8, [2, 5, 6]), (12, [4])]  # two lengths; the second call has another count of documents
out = {}
if phase == "refuse":  # one signature for every call: the second length's call reaches the first's function
    compilation.call_signature = lambda args: "one"
plain = torch.compile(step, fullgraph=True, dynamic=False)
pre = compilation.Precompiled(step, "step", folder, plain)
out["pre"] = [run(pre, T, cuts) for T, cuts in calls]
out["plain"] = [run(plain, T, cuts) for T, cuts in calls]
out["lines"] = [e[1] for e in compilation.PRECOMPILED]
out["kinds"] = [e[0] for e in compilation.PRECOMPILED]
print("RESULT " + json.dumps(out))
'''


def spec_step(p, x, cu):
    """The step of PRECOMPILED_SCRIPT written again, in float64: mean over rows and outputs of ((relu(x W1))^2 W2)^2
    times s, plus the mean squared document length over T."""
    p = {k: v.double() for k, v in p.items()}
    h = torch.clamp(x.double() @ p["w1"], min=0) ** 2
    lengths = torch.diff(cu.double())
    return ((h @ p["w2"]) ** 2).mean() * p["s"] + (lengths ** 2).mean() / x.shape[0]


def _spec_results(T, cuts):
    g = torch.Generator().manual_seed(T)
    p = {"w1": torch.randn(16, 24, generator=g), "w2": torch.randn(24, 8, generator=g) / 5, "s": torch.tensor(0.75)}
    p = {k: v.double().requires_grad_() for k, v in p.items()}
    x, cu = torch.randn(T, 16, generator=g), torch.tensor([0, *cuts, T])
    loss = spec_step(p, x, cu)
    loss.backward()
    return [loss.item()] + [p[k].grad.flatten().tolist() for k in sorted(p)]


def _precompiled_phase(tmp_path, folder, phase):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor_{phase}"))
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    r = subprocess.run([sys.executable, "-c", PRECOMPILED_SCRIPT, str(Path(compilation.__file__).parent), str(folder),
                        phase], env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(lines[0][7:])


def _assert_near_spec(results, calls=((8, [3]), (8, [2, 5, 6]), (12, [4]))):
    """fp32 against the float64 spec: relative 1e-5 of each quantity's largest magnitude (a few fp32 roundings
    over sums of at most 24 terms)."""
    for got, (T, cuts) in zip(results, calls):
        want = _spec_results(T, cuts)
        for g, w in zip(got, want):
            g, w = torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64)
            assert torch.allclose(g, w, rtol=0, atol=1e-5 * max(w.abs().max().item(), 1e-3)), (T, cuts, g, w)


def test_call_signatures_tell_apart_what_the_guards_check():
    """call_signature: another dtype, size, stride, requires_grad, device, dict key or non-tensor value is another
    signature; another length in a dimension marked dynamic is not. quick_signature tells apart at least as much
    (for one nesting), and is hashable."""
    def args(x=None, cu=None, extra=3, key="w"):
        x = torch.zeros(4, 8) if x is None else x
        cu = torch.tensor([0, 2, 4], dtype=torch.int32) if cu is None else cu
        torch._dynamo.mark_dynamic(cu, 0)
        return ({key: torch.ones(8, 8, requires_grad=True)}, x, cu, extra)

    base = args()
    same = [args(cu=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32))]
    other = [args(x=torch.zeros(4, 8, dtype=torch.bfloat16)), args(x=torch.zeros(5, 8)),
             args(x=torch.zeros(8, 4).T),
             args(x=torch.zeros(4, 8, requires_grad=True)), args(x=torch.zeros(4, 8, device="meta")),
             args(extra=4), args(extra=None), args(key="v")]
    sig = compilation.call_signature(base)
    assert all(compilation.call_signature(a) == sig for a in same)
    assert len({sig, *(compilation.call_signature(a) for a in other)}) == len(other) + 1
    quick = compilation.quick_signature(torch.utils._pytree.tree_leaves(base))
    hash(quick)
    for a in other[:-1]:  # the last differs in its nesting only: the guards' to refuse
        assert compilation.quick_signature(torch.utils._pytree.tree_leaves(a)) != quick


@pytest.mark.skipif(not (torch.cuda.is_available() or shutil.which("g++") or shutil.which("c++")),
                    reason="inductor's CPU code needs a C++ compiler")
def test_precompiled_saves_whole_functions_then_loads_them_bitwise(tmp_path):
    """A first process compiles the step ahead of time once per signature (two micro-batch lengths; the second
    call of the first length, with another count of documents, reuses its function: cu's length is dynamic) and
    saves each; its results are those of torch.compile's plain function bit for bit, and the float64 spec's to
    fp32 rounding. A second process, with an inductor cache of its own (empty), loads both files instead of
    compiling, and gets the first's bits; with one file cut short it compiles that one again (and says why)."""
    folder = tmp_path / "aot"
    first = _precompiled_phase(tmp_path, folder, "first")
    assert first["kinds"] == ["compiled", "compiled"], first["lines"]
    assert all(re.fullmatch(r"precompiled: step [0-9a-f]{16}: compiled and saved \d+\.\d MiB in \d+\.\d s "
                            r"\(fx_graph_cache \d+/\d+ hits\)", x) for x in first["lines"]), first["lines"]
    assert first["pre"] == first["plain"], "the precompiled function is not torch.compile's"
    _assert_near_spec(first["pre"])
    files = sorted(folder.glob("step-*.aot"))
    assert len(files) == 2 and not list(folder.glob(".*.tmp")), sorted(folder.iterdir())

    second = _precompiled_phase(tmp_path, folder, "second")
    assert second["kinds"] == ["loaded", "loaded"], second["lines"]
    assert second["pre"] == first["pre"], "the loaded functions computed other bits"

    files[1].write_bytes(files[1].read_bytes()[:1000])  # an interrupted copy
    third = _precompiled_phase(tmp_path, folder, "third")
    assert sorted(third["kinds"]) == ["compiled", "loaded"], third["lines"]
    redone = next(x for x, k in zip(third["lines"], third["kinds"]) if k == "compiled")
    assert f"{files[1]} did not load (" in redone and "compiled and saved" in redone, redone
    assert third["pre"] == first["pre"]


@pytest.mark.skipif(not (torch.cuda.is_available() or shutil.which("g++") or shutil.which("c++")),
                    reason="inductor's CPU code needs a C++ compiler")
def test_precompiled_function_whose_guards_refuse_a_call_leaves_it_to_torch_compile(tmp_path):
    """With call_signature made blind to the length, the 12-row call reaches the function compiled for 8 rows: its
    guards refuse it, one line says so, and that call and the next ones of the signature go to the plain
    torch.compile, with the right results."""
    out = _precompiled_phase(tmp_path, tmp_path / "aot", "refuse")
    assert out["kinds"] == ["compiled", "plain"], out["lines"]
    assert re.fullmatch(r"precompiled: step [0-9a-f]{16}: its guards refuse this call: compiled as usual",
                        out["lines"][1]), out["lines"]
    assert out["pre"] == out["plain"]
    _assert_near_spec(out["pre"])
