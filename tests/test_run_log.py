"""Tests of run_log.py: the code a log copies (every imported repository module but tests and benchmarks, the
modules beside train_gpt.py included), the header, the footer and the step clock. A smoke run's log:
test_train_gpt.py; a log never overwritten and the run id's checks: test_reliability.py."""
import os
import platform
import sys
from pathlib import Path

import torch

import run_log
import train_gpt as tg  # noqa: F401  (imports what a training run imports)
from distributed import Dist

REPO = Path(__file__).resolve().parents[1]


def test_logged_sources_are_the_imported_project_modules():
    """The logged code is exactly train_gpt.py and the repo modules imported, sorted; never tests or benchmark
    cases (even when the session imported them)."""
    import benchmarks.transpose  # noqa: F401  (a test session may import it; a training run never does)
    imported = set()
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path) and Path(path).resolve().is_relative_to(REPO):
            imported.add(Path(path).resolve().relative_to(REPO).as_posix())
    # hidden folders (a virtual environment made inside the repo, as the README does) are never logged
    expected = sorted({"train_gpt.py"} | {p for p in imported if not p.startswith(("tests/", "benchmarks/"))
                                          and not any(part.startswith(".") for part in p.split("/"))})
    assert run_log.logged_sources() == expected
    assert {"checkpoints.py", "cli.py", "compilation.py", "evaluation.py", "flags.py", "profiling.py",
            "run_log.py"} <= set(expected)
    dump = run_log.source_dump()
    assert dump.startswith("# ===== file: checkpoints.py =====\n") and "# ===== file: train_gpt.py =====" in dump


def test_header_names_versions_corpus_and_hyperparameters(tmp_path):
    val = tmp_path / "v.bin"
    val.write_bytes(b"x" * 100)
    lines = run_log.header_lines(tg.smoke_hyperparameters(), Dist(), [tmp_path / "t.bin"], [val])
    keys = [line.split(": ", 1)[0] for line in lines[:10]]
    assert keys == ["git_sha", "python", "torch", "triton", "cuda", "gpu", "world_size", "host", "corpus",
                    "hyperparameters"]
    assert lines[5] == "gpu: cpu x 1" or torch.cuda.is_available()
    assert " logical CPUs usable" in lines[7] and lines[7].endswith(" (1, 5, 15 min)")


def test_host_line_names_the_cpu_the_usable_cpus_a_quota_and_the_load(tmp_path, monkeypatch):
    """host_line: the first "model name" of cpuinfo, the affinity's CPU count of the machine's, a cgroup v2 quota
    (quota / period CPUs; none for "max"), the three load averages; without those files the platform's name and no
    quota."""
    info, quota = tmp_path / "cpuinfo", tmp_path / "cpu.max"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000 @ 3.0GHz\nflags\t: x\n\nprocessor\t: 1\n"
                    "model name\t: Other\ncpu family\t: 9\n")
    quota.write_text("1600000 100000\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 0.25, 12.0), raising=False)
    assert run_log.host_line(info, quota) == ("host: Test CPU 9000 @ 3.0GHz, 3 of 64 logical CPUs usable, a cgroup "
                                              "quota of 16 CPUs, load average 1.50 0.25 12.00 (1, 5, 15 min)")
    quota.write_text("max 100000\n")
    assert run_log.host_line(info, quota) == ("host: Test CPU 9000 @ 3.0GHz, 3 of 64 logical CPUs usable, load "
                                              "average 1.50 0.25 12.00 (1, 5, 15 min)")
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert run_log.host_line(tmp_path / "none", tmp_path / "none") == (
        "host: x86_64, 3 of 64 logical CPUs usable, load average 1.50 0.25 12.00 (1, 5, 15 min)")


def test_host_line_numbers_tell_apart_cpus_of_one_generic_name(tmp_path, monkeypatch):
    """A virtual machine's cpuinfo may name every CPU "Intel(R) Xeon(R) Processor": the first processor's family,
    model, stepping and clock follow the name (the second processor's are not read); a field that is missing is
    left out."""
    info, none = tmp_path / "cpuinfo", tmp_path / "none"
    block = ("processor\t: {p}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {m}\n"
             "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: {s}\ncpu MHz\t\t: {mhz}\n\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)
    tail = ", 16 of 16 logical CPUs usable, load average 0.00 0.00 0.00 (1, 5, 15 min)"
    info.write_text(block.format(p=0, m=143, s=8, mhz="2099.998") + block.format(p=1, m=106, s=6, mhz="2600.000"))
    assert run_log.host_line(info, none) == (
        "host: Intel(R) Xeon(R) Processor (family 6, model 143, stepping 8, 2100 MHz)" + tail)
    info.write_text(block.format(p=0, m=106, s=6, mhz="2600.000").replace("stepping\t: 6\n", ""))
    assert run_log.host_line(info, none) == "host: Intel(R) Xeon(R) Processor (family 6, model 106, 2600 MHz)" + tail


def test_footer_tokens_per_second_and_stage_means():
    lines = []
    run_log.log_summary(lines.append, Dist(world=2), tokens=4000, train_ms=2000.0,
                        stage_ms={1: [30.0, 50.0], 0: [10.0]}, matmul_weights=10**8)
    assert lines[0] == "tokens_per_s_per_gpu: 1000"  # 4000 tokens over 2 s on 2 ranks
    assert lines[1] == "mfu: n/a (no peak FLOP/s figure for this device)"  # a CPU Dist
    assert lines[-1] == "stage_step_avg: stage0:10.00ms stage1:40.00ms"
    lines.clear()
    run_log.log_summary(lines.append, Dist(), tokens=0, train_ms=0.0, stage_ms={}, matmul_weights=1)
    assert lines[0] == "tokens_per_s_per_gpu: 0", "a resumed run with no step left"


class FakeEvent:
    """Stands in for torch.cuda.Event: record() and synchronize() go to a shared journal; synchronize() also
    advances the fake clock, as a wait for the device does."""
    journal, now = [], [0.0]

    def record(self):
        FakeEvent.journal.append(("record", self))

    def synchronize(self):
        FakeEvent.now[0] += 5.0
        FakeEvent.journal.append(("sync", self))


def test_step_clock_times_a_step_when_the_device_is_seen_done(monkeypatch):
    """Spec of run_log.StepClock with events: queued(step, loss) records an event after the step's work and keeps
    a copy of the loss (the tensor may change after); wait() blocks on that event and only then notes the time
    and reads the loss; finished() hands each finished step over once, in step order, with the train time at its
    end; a step queued before the previous one was waited for finishes the previous one first. stop() waits for
    the queued step and adds the time since start() to the train time; the time until the next start() is not
    counted, and a step's time (step_ms) runs from the previous step's end or the clock's start. Without events
    (the CPU) a step is finished, at the time queued() is called, with its loss."""
    FakeEvent.journal.clear()
    FakeEvent.now[0] = 100.0
    monkeypatch.setattr(run_log.time, "perf_counter", lambda: FakeEvent.now[0])
    clock = run_log.StepClock(torch.device("cpu"), 1000.0, event=FakeEvent)
    clock.start()
    loss = torch.tensor(2.5)
    clock.queued(0, loss)
    loss.fill_(-1.0)  # the next step's loss written into the same tensor: the clock kept step 0's
    (kind, ev0), = FakeEvent.journal
    assert kind == "record" and clock.finished() == [], "a step is not finished before the wait"
    clock.wait()
    assert FakeEvent.journal[-1] == ("sync", ev0)
    assert clock.finished() == [(0, 6000.0, 2.5)], "time and loss taken after the device was seen done"
    assert clock.finished() == []
    clock.wait()  # nothing queued: no wait
    assert len(FakeEvent.journal) == 2
    clock.queued(1, torch.tensor(1.0))
    clock.queued(2, torch.tensor(4.0))  # step 1 not waited for: finished first, with its own loss
    clock.queued(3, None)
    clock.stop()  # waits for step 3 (at 120 s); the train time counts up to here
    assert clock.finished() == [(1, 11000.0, 1.0), (2, 16000.0, 4.0), (3, 21000.0, None)]
    assert [k for k, _ in FakeEvent.journal] == ["record", "sync"] * 4
    assert clock.ms == 21000.0
    FakeEvent.now[0] = 150.0  # 30 s untimed (a validation)
    clock.start()
    clock.queued(4, None)
    clock.wait()
    assert clock.finished() == [(4, 26000.0, None)]
    assert clock.step_ms == {0: 5000.0, 1: 5000.0, 2: 5000.0, 3: 5000.0, 4: 5000.0}

    cpu = run_log.StepClock(torch.device("cpu"))
    cpu.start()
    FakeEvent.now[0] = 157.0
    cpu.queued(7, torch.tensor(3.0))
    assert cpu.finished() == [(7, 2000.0, 3.0)] and cpu.step_ms == {7: 2000.0}
    cpu.wait()
    assert cpu.finished() == []


def _fake_proc(root, uptime, me, parent, parent_cmd, ticks):
    """A /proc with the uptime, this process's stat and its parent's stat and cmdline (start times in seconds
    since boot; stat's field 22 in clock ticks, after a command name holding spaces and parentheses)."""
    def stat(pid, start):
        fields = ["S", "1", "1", "1"] + ["0"] * 15 + [str(int(round(start * ticks)))] + ["0"] * 30
        (root / pid).mkdir(parents=True, exist_ok=True)
        (root / pid / "stat").write_text(f"{pid} (py (a) b) " + " ".join(fields) + "\n")
    root.mkdir()
    (root / "uptime").write_text(f"{uptime:.2f} 12345.00\n")
    stat("self", me)
    stat(str(os.getppid()), parent)
    (root / str(os.getppid()) / "cmdline").write_bytes(parent_cmd)


def test_launch_phases_split_torchrun_from_this_process(tmp_path):
    """Spec: where the parent's command line names torchrun (as the script or as python -m torch.distributed.run),
    "torchrun" runs from the parent's start to this process's, then "imports" from this process's start to now
    (/proc/uptime); any other parent: "imports" alone. Starts are stat's 22nd field / clock ticks per second. No
    /proc: no phases."""
    ticks = os.sysconf("SC_CLK_TCK")
    cases = [(b"/venv/bin/python3\0/venv/bin/torchrun\0--nproc_per_node=8\0train_gpt.py\0",
              [("torchrun", 996.5 - 990.0), ("imports", 1000.0 - 996.5)]),
             (b"python3\0-m\0torch.distributed.run\0train_gpt.py\0",
              [("torchrun", 996.5 - 990.0), ("imports", 1000.0 - 996.5)]),
             (b"bash\0-c\0python train_gpt.py\0", [("imports", 1000.0 - 996.5)])]
    for i, (cmd, want) in enumerate(cases):
        _fake_proc(tmp_path / str(i), 1000.0, 996.5, 990.0, cmd, ticks)
        got = run_log.launch_phases(tmp_path / str(i))
        assert [n for n, _ in got] == [n for n, _ in want], cmd
        assert all(abs(g - w) < 2 / ticks for (_, g), (_, w) in zip(got, want)), (cmd, got)
    assert run_log.launch_phases(tmp_path / "nothing") == []
    if Path("/proc/self/stat").exists():
        phases = run_log.launch_phases()
        assert phases and phases[-1][0] == "imports" and all(0 <= s < 24 * 3600 for _, s in phases)


def test_startup_clock_adds_its_phases_to_the_time_since_launch(monkeypatch):
    """Spec: line() gives the sum of the phases, then each phase with its seconds in order; a phase runs from the
    previous lap (or the clock's start) to its own; the first are the launch's phases when they are known."""
    now = [50.0]
    monkeypatch.setattr(run_log.time, "perf_counter", lambda: now[0])
    clock = run_log.StartupClock([("torchrun", 2.75), ("imports", 4.5)])
    now[0] = 52.0
    clock.lap("process group")
    now[0] = 62.5
    clock.lap("parameters")
    assert clock.line() == ("startup_s: 19.8 (from the launch to the compile warmup: torchrun 2.8, imports 4.5, "
                            "process group 2.0, parameters 10.5)")
    unknown = run_log.StartupClock([])
    now[0] = 63.0
    unknown.lap("process group")
    assert unknown.line() == "startup_s: 0.5 (from main to the compile warmup: process group 0.5)"
