"""The run's files and log: the shards and the run id, the code that ran, the header, the writer, the step clock
and the footer (train_gpt.py's LOG_DIR/RUN_ID.txt).

A log is self-contained: it starts with the source of every repository module the run imported
(``source_dump``: train_gpt.py and the modules beside it, kernels/, data/; never tests/ or benchmarks/), then a
line of 100 '=', the header (``header_lines``: git sha, versions, GPU, world size, corpus, hyperparameters, the
run a resumed run continues, nvidia-smi), another line of 100 '=', and the run's events; ``open_log`` writes all
that before the events, and ``log_summary`` the footer after them. ``Logger`` writes on rank 0 only and never
overwrites a log: a run id is checked before anything starts (``check_run_id``: a plain name whose log and
checkpoint folder do not exist yet) or made new (``new_run_id``).
"""
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from data.shards import shard_files
from flags import SettingsError
from kernels.hardware import ceilings_for, git_sha

REPO = Path(__file__).resolve().parent


RUN_ID_CHARS = "letters, digits, '.', '_' and '-', not starting with '.'"
NOT_LOGGED = ("tests", "benchmarks")  # repo folders never part of a run (imported only by a test session)


def logged_sources():
    """Paths (relative to the repo, sorted) of the code that ran: train_gpt.py and every imported module whose
    file lies in the repo, except NOT_LOGGED and hidden folders (virtual environments carried in the tree)."""
    rels = {"train_gpt.py"}
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py") or not os.path.isabs(path):
            continue  # built-in, extension or synthetic (a relative __file__, e.g. torch's "_classes.py")
        try:
            rel = Path(path).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts[0] not in NOT_LOGGED and not any(part.startswith(".") or part == "site-packages" for part in rel.parts):
            rels.add(rel.as_posix())
    return sorted(rels)


def source_dump():
    return "\n".join(f"# ===== file: {rel} =====\n" + (REPO / rel).read_text() for rel in logged_sources())


def nvidia_smi():
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi: not available"


class Logger:
    def __init__(self, path, active):
        self.path, self.active = path, active
        if active:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.open("x").close()  # never truncate a log: an existing one raises FileExistsError

    def __call__(self, line, console=True):
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if console:
            print(line, flush=True)


def host_line(cpuinfo="/proc/cpuinfo", cpu_max="/sys/fs/cgroup/cpu.max"):
    """The log's ``host:`` line: the CPU model (Linux's /proc/cpuinfo, else platform.processor()) with the first
    CPU's family, model and stepping numbers and clock where cpuinfo has them (a virtual machine's model name can
    be a generic "Intel(R) Xeon(R) Processor"; the numbers still tell processor generations apart), the logical CPUs
    this process may run on (its affinity; a cgroup CPU quota, where one is set, as a count of CPUs) of the
    machine's, and the load average at the start. Stage 0's short steps wait on the host's launches, so its step
    time depends on the host: two runs on different or differently loaded hosts are no pair."""
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        first = {}  # the first processor's fields: cpuinfo's blocks are separated by blank lines
        for line in Path(cpuinfo).read_text().splitlines():
            if not line.strip():
                if first:
                    break
                continue
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
        model = first.get("model name", model)
        ids = [f"{name} {first[key]}" for key, name in (("cpu family", "family"), ("model", "model"),
                                                          ("stepping", "stepping")) if first.get(key)]
        if first.get("cpu MHz"):
            ids.append(f"{float(first['cpu MHz']):.0f} MHz")
        if ids:
            model += f" ({', '.join(ids)})"
    except (OSError, ValueError):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = ""
    try:
        limit, period = Path(cpu_max).read_text().split()[:2]
        if limit != "max":
            quota = f", a cgroup quota of {int(limit) / int(period):g} CPUs"
    except (OSError, ValueError):
        pass
    load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)" \
        if hasattr(os, "getloadavg") else "load average unknown"
    return f"host: {model}, {usable} of {os.cpu_count()} logical CPUs usable{quota}, {load}"


def header_lines(hp, d, train_files, val_files, continues=None):
    """The header's lines; continues: the run a resumed run continues ({"checkpoint", "step", "id", "log"}), named in
    a `continues:` line."""
    gpu = (f"{torch.cuda.get_device_name(d.device)} x {d.world}" if d.device.type == "cuda"
           else f"cpu x {d.world}")
    val_sha = hashlib.sha256(Path(val_files[0]).read_bytes()).hexdigest()[:16]
    resumed = [] if continues is None else [
        f"continues: run {continues['id']} (log {continues['log'] or 'not named in the checkpoint'}) from "
        f"{continues['checkpoint']}, step {continues['step']}"]
    hp_json = json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(hp).items()
                          if k != "stages"} | {"stages": [dataclasses.asdict(s) for s in hp.stages]})
    return [
        f"git_sha: {git_sha()}",
        f"python: {platform.python_version()}",
        f"torch: {torch.__version__}",
        f"triton: {triton.__version__}",
        f"cuda: {torch.version.cuda}",
        f"gpu: {gpu}",
        f"world_size: {d.world}",
        host_line(),
        f"corpus: {hp.train_files} (val sha256[:16] {val_sha})",
        f"hyperparameters: {hp_json}",
        *resumed,
        f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
        nvidia_smi() if d.device.type == "cuda" else "nvidia-smi: no GPU",
    ]


def resolve_files(hp):
    """(train shard paths, val shard paths) of hp's globs; a missing corpus names the commands that make one."""
    try:
        return shard_files(hp.train_files), shard_files(hp.val_files)
    except FileNotFoundError as e:
        hint = ("" if "cached_fineweb10B" in str(e) else
                "; get the FineWeb shards with `python data/cached_fineweb10B.py 9`")
        raise FileNotFoundError(f"{e}{hint}, or make shards from your own text with `python data/prepare_text.py` "
                                f"and point --train-files / --val-files at them") from e


def check_run_id(run_id, log_dir, checkpoint_dir):
    """SettingsError for a --run-id that is no plain name (RUN_ID_CHARS) or is taken: a run never overwrites
    another's log LOG_DIR/RUN_ID.txt or checkpoints CHECKPOINT_DIR/RUN_ID."""
    if not run_id or run_id.startswith(".") or any(not (c.isalnum() or c in "._-") for c in run_id):
        raise SettingsError(f"--run-id {run_id!r}: use {RUN_ID_CHARS}")
    for taken in (Path(log_dir) / f"{run_id}.txt", Path(checkpoint_dir) / run_id):
        if taken.exists():
            raise SettingsError(f"--run-id {run_id} is taken: {taken} exists (a run never overwrites another's "
                                f"log or checkpoints; choose another id, or leave --run-id out for a new one)")


def new_run_id(d):
    """A fresh run id (date, time, random suffix), the same on every rank: rank 0's, broadcast."""
    run_id = [f"{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:8]}"]
    if d.world > 1:
        dist.broadcast_object_list(run_id, src=0)
    return run_id[0]


def open_log(hp, args, d, train_files, val_files, run_id, continues=None):
    """The run's log LOG_DIR/RUN_ID.txt (args.log_dir), started with the code that ran and the header (continues:
    as header_lines takes it), then its own path and the checkpoint folder's (printed too). The log is created,
    never overwritten: check_run_id refused a taken --run-id, and a log made since then by another process is a
    SettingsError here."""
    path = Path(args.log_dir) / f"{run_id}.txt"
    try:
        log = Logger(path, d.rank == 0)
    except FileExistsError:
        raise SettingsError(f"--run-id {run_id}: the log {path} exists (a log is never overwritten)") from None
    log(source_dump(), console=False)
    log("=" * 100, console=False)
    for line in header_lines(hp, d, train_files, val_files, continues):
        log(line, console=False)
    log("=" * 100, console=False)
    log(f"log_file: {path}")
    log(f"checkpoint_dir: {Path(args.checkpoint_dir) / run_id}")
    return log


def dir_bytes(path):
    """The bytes of the files under the folder ``path``, subfolders included."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def launch_phases(proc="/proc"):
    """The wait from the launch to now, split: [("torchrun", s), ("imports", s)] where this process's parent is
    torchrun (its agent imports torch and starts the ranks: from its start to this process's), else [("imports",
    s)]; "imports" runs from this process's start to now (the interpreter and the imports, up to main). From /proc
    (Linux); [] where it cannot be read."""
    try:
        uptime = float(Path(proc, "uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")

        def started(pid):  # field 22 of /proc/PID/stat, after the parenthesised command name (which may hold spaces)
            return int(Path(proc, str(pid), "stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks

        me = started("self")
        parent = Path(proc, str(os.getppid()), "cmdline").read_bytes().replace(b"\0", b" ")
        phases = []
        if b"torchrun" in parent or b"torch.distributed.run" in parent:
            phases.append(("torchrun", max(0.0, me - started(os.getppid()))))
        return phases + [("imports", max(0.0, uptime - me))]
    except (OSError, ValueError, IndexError):
        return []


class StartupClock:
    """The wait from the launch to the compile warmup, by phase: ``lap(name)`` ends a phase, ``line()`` is the
    log's ``startup_s:`` line. before_main: ``launch_phases`` when the clock starts (torchrun, imports), the
    line's first phases; without them (no /proc) the line counts from main."""

    def __init__(self, before_main):
        self.t = time.perf_counter()
        self.from_launch = bool(before_main)
        self.phases = list(before_main)

    def lap(self, name):
        now = time.perf_counter()
        self.phases.append((name, now - self.t))
        self.t = now

    def line(self):
        total = sum(s for _, s in self.phases)
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases)
        return (f"startup_s: {total:.1f} (from {'the launch' if self.from_launch else 'main'} to the compile warmup: "
                f"{parts})")


class StepClock:
    """The train time, and when each timed training step finished on the device: the step lines' times.

    The clock runs between start() and stop() (validation, evaluation and saves are not timed); ``ms`` is the train
    time up to the last stop(). On a GPU the host runs ahead of the device, so the host's clock after launching a
    step says when the step was queued, not when it ran: a host pause shows up as a slow step followed by a fast one
    although the device never waited. Here Trainer.train_step(step, clock=...) calls ``queued`` at its end (an event
    is recorded after the step's work, its loss copied into pinned memory without a sync) and ``wait`` once the next
    step's first micro-batch is queued: the host blocks until the previous step is done and notes the time. The host
    is then at most about one step ahead, and while it waits the device has that micro-batch to run. On the CPU a
    step is done when train_step returns. ``finished`` hands over [(step, train time in ms at its end, loss or
    None)] in step order, each once; ``step_ms`` {step: ms} keeps each step's time: its end minus the previous
    step's, or the clock's (re)start.
    event: the event type (torch.cuda.Event on a GPU; tests pass a stand-in); None on the CPU."""

    def __init__(self, device, ms=0.0, event=None):
        self.cuda = device.type == "cuda"
        self.event = torch.cuda.Event if event is None and self.cuda else event
        self.ms = ms
        self.step_ms = {}
        self._loss = torch.zeros((), dtype=torch.float32, pin_memory=self.cuda)  # the last loss
        self._last = None  # (step, event, has a loss) of the step queued last, not yet seen done
        self._done = []
        self._t0 = self._prev = None  # perf_counter seconds: the clock's (re)start, the last finished step's end

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def start(self):
        """The clock runs from now (after the device's queued work)."""
        self._sync()
        self._t0, self._prev = time.perf_counter(), None

    def stop(self):
        """The clock stops once the device has finished every queued step; ms counts up to here."""
        self.wait()
        self._sync()
        self.ms += 1000 * (time.perf_counter() - self._t0)

    def _finish(self, step, loss):
        t = time.perf_counter()
        self.step_ms[step] = 1000 * (t - (self._t0 if self._prev is None else self._prev))
        self._prev = t
        self._done.append((step, self.ms + 1000 * (t - self._t0), loss))

    def queued(self, step, loss=None):
        """Step ``step`` is fully queued; loss: its 0-d loss tensor, or None."""
        self.wait()  # a step queued before the previous one was waited for: that one first (and its loss read)
        if loss is not None:
            self._loss.copy_(loss.detach(), non_blocking=self.event is not None)
        if self.event is None:
            self._finish(step, None if loss is None else self._loss.item())
            return
        ev = self.event()
        ev.record()
        self._last = (step, ev, loss is not None)

    def wait(self):
        """Block until the step queued last has finished on the device; notes when, and reads its loss."""
        if self._last is None:
            return
        step, ev, has_loss = self._last
        self._last = None
        ev.synchronize()
        self._finish(step, self._loss.item() if has_loss else None)

    def finished(self):
        out, self._done = self._done, []
        return out


def path_lines(hp, device, fp8, fp8_why, grad_in_fwd, fused_mlp, embed_accs, compiled, options, precompiled=False):
    """The log's lines on the paths train_gpt.build_fns chose for ``device`` and why: (lm_head_matmul,
    embedding_backward, mlp, compile_options). fp8_why: kernels.cross_entropy.fp8_head_support's reason; options:
    the training step's inductor options (--cpp-wrapper) or None; precompiled: --compile-cache's whole compiled
    functions (compilation.Precompiled)."""
    if fp8:
        head = f"fp8 ({fp8_why}); e5m2 gradient: {'CE forward' if grad_in_fwd else 'row'} kernel + transpose copy"
    else:
        head = f"{hp.param_dtype} ({'--no-fp8-head' if not hp.fp8_head else fp8_why})"
    if device.type == "cuda":  # the CPU runs the CE reference
        head += ("; CE gradient written by the forward kernel (--ce-grad-in-forward)" if grad_in_fwd else
                 "; CE forward and backward kernels (--no-ce-grad-in-forward)")
    embed = ("added into the optimizer's fp32 accumulators (--embed-grad-to-acc)" if embed_accs else
             "dense gradient, folded into the optimizer's fp32 accumulators ("
             + ("torch's embedding on the CPU)" if hp.embed_grad_to_acc else "--no-embed-grad-to-acc)"))
    mlp = ("kernels.mlp.relu2_mlp (--fused-mlp)" if fused_mlp else "torch: matmul, then ReLU² ("
           + ("--no-fused-mlp)" if not hp.fused_mlp else f"the fused kernel takes CUDA and bf16/fp16, "
                                                        f"not {device.type} {hp.param_dtype})"))
    if hp.mlp_act_only:  # a mode of the fused kernel: unused where the composite runs
        mlp += ("; act saved alone, relu(pre) = sqrt(act) in the backward (--mlp-act-only)" if fused_mlp else
                "; --mlp-act-only unused (a mode of the fused kernel)")
    if not compiled:
        return head, embed, mlp, "not compiled"
    compile_line = (f"train_step inductor options {options} (--cpp-wrapper: opt-in, outside the public rules)"
                    if options else "none beyond fullgraph=True, dynamic=False (record #74's)")
    if hp.dynamic_tokens:
        compile_line += ("; train_step's micro-batch length a dynamic size, one graph for every stage "
                         "(--dynamic-tokens: opt-in, torch._dynamo.mark_dynamic on its inputs)")
    if precompiled:
        compile_line += ("; train_step and val_step compiled ahead of time and kept whole in --compile-cache "
                         "(torch.compile(...).aot_compile; opt-in: torch 2.11 needs torch._dynamo.config."
                         "enable_aot_compile set)")
    return head, embed, mlp, compile_line


def log_summary(log, d, tokens, train_ms, stage_ms, matmul_weights):
    """The footer: peak memory (CUDA), tokens/s per GPU (``tokens``: what the timed steps trained on, all ranks),
    MFU (6 FLOPs per matmul weight per token, forward + backward; ``matmul_weights``: the model's, per token)
    against the measured matmul ceiling (kernels/hardware.py), and per stage the mean step time (stage_ms:
    {stage index: [step ms]})."""
    cuda = d.device.type == "cuda"
    if cuda:
        log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
            f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    tok_s = tokens / d.world / max(train_ms / 1000, 1e-9)
    log(f"tokens_per_s_per_gpu: {tok_s:.0f}")
    name = torch.cuda.get_device_name(d.device) if cuda else ""
    ceilings = ceilings_for(name) if cuda else None
    if ceilings:
        peak = ceilings[1]
        log(f"mfu: {100 * 6 * matmul_weights * tok_s / peak:.1f}% (6 FLOPs per matmul weight per token, "
            f"attention scores excluded, of {peak / 1e12:.0f} TFLOP/s: measured dense bf16 matmul on {name}, "
            f"kernels/hardware.py)")
    else:
        log("mfu: n/a (no peak FLOP/s figure for this device)")
    log("stage_step_avg: " + " ".join(f"stage{i}:{sum(v) / len(v):.2f}ms" for i, v in sorted(stage_ms.items())))
