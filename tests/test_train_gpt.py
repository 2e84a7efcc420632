"""Tests of train_gpt.py: smoke run end to end (loss falls, log format, checkpoint, Ctrl-C, bitwise resume), the first
run without shards (on the repository's text), exact gradient accumulation (world sizes 2, 4 and 8 on gloo:
tests/test_world_sizes.py), the flat forward against a plain per-layer reference, the document boundaries and the
GPU attention op, the data loader's rank split, the schedule, and the error messages. CPU: the model runs eagerly,
the kernels in Triton's interpreter.
"""
import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from test_model import spec_forward
from tolerances import assert_close_report, assert_matches_torch

import checkpoints
import cli
import compilation
import run_log
import train_gpt as tg
from compilation import unique_graphs
from distributed import Dist
from data.prepare_text import GPT2_CACHE_NAMES
from data.shards import load_shard, shard_files, write_shard
from flags import field_comments
from kernels._checks import interpreting
from kernels.attention import dense_attend, doc_attention, doc_attention_bwd, doc_attention_fwd
from kernels.cross_entropy import Fp8Weights
from kernels.polar_express import polar_express_ref

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
# records/ is a folder of records, not a package: load its log parser (the one parser of step lines) by path.
_spec = importlib.util.spec_from_file_location("records_compare", REPO / "records" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _gpt2_cache_dir():
    """tiktoken's gpt2 files (--prefix-loss): TIKTOKEN_CACHE_DIR, or the team's shared copy beside the checkout or
    its worktree folder; None where neither has them."""
    for c in (os.environ.get("TIKTOKEN_CACHE_DIR"), REPO.parent / "shared" / "tiktoken_cache",
              REPO.parent.parent / "shared" / "tiktoken_cache"):
        if c and all((Path(c) / f).is_file() for f in GPT2_CACHE_NAMES.values()):
            return Path(c)
    return None


# ----------------------------------------------------------------------------------------------------
# Smoke data: documents that follow a learnable rule (next = prev + 7..9 mod 511), BOS = 511, vocab 512


def _make_shard(path, n_tokens, seed, vocab=512, bos=None):
    """Documents of the rule next = prev + 7..9 (mod vocab - 1), each after a BOS (vocab - 1, or bos)."""
    bos = vocab - 1 if bos is None else bos
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(20, 300))
        doc = np.cumsum(np.concatenate([[rng.integers(0, vocab - 1)], 7 + rng.integers(0, 3, size=n - 1)]))
        docs.append(np.concatenate([[bos], doc % (vocab - 1)]))
        total += n + 1
    write_shard(path, np.concatenate(docs)[:n_tokens].astype(np.uint16))


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("smoke_data")
    _make_shard(d / "smoke_train_000001.bin", 120_000, 1)
    _make_shard(d / "smoke_train_000002.bin", 120_000, 2)
    _make_shard(d / "smoke_val_000000.bin", 20_000, 3)
    return d


# The same data at vocabulary 128 (BOS 127), with a 64-row bigram table: for the trainer tests that run
# kernels.embedding's kernels in the interpreter, which cost a program per 64 rows of each table (512 + 2 x 512 +
# 256 rows at the smoke vocabulary: 28 programs per micro-step and trainer, here 7).
SMALL_VOCAB = dict(vocab_size=128, bos_id=127, bigram_vocab_size=64)


@pytest.fixture(scope="module")
def small_vocab_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_vocab_data")
    _make_shard(d / "smoke_train_000001.bin", 40_000, 1, vocab=128)
    _make_shard(d / "smoke_val_000000.bin", 20_000, 3, vocab=128)
    return d


def _flags(argv):
    """(args, hp) of train_gpt.py's command line argv."""
    return cli.parse_args(argv, tg.Hyperparameters, tg.smoke_hyperparameters)


def _smoke_argv(data, out, run_id, *extra):
    return ["--smoke", "--train-files", str(data / "smoke_train_*.bin"), "--val-files", str(data / "smoke_val_*.bin"),
            "--log-dir", str(out / "logs"), "--checkpoint-dir", str(out / "ckpt"), "--run-id", run_id, *extra]


# The smoke model with two layers instead of four, every feature still on (two lanes from layer 1, the skip from
# layer 0 to 1): for the tests of the run's machinery (the timed loop, profiling, the world-size command), which
# the model's size does not change. On the CPU a step's time is mostly a cost per operator (Python, autograd, the
# profiler's events), so half the layers take about half the time.
TWO_LAYERS = {"num_layers": 2, "ve_tables": (0, 0), "long_window_layers": (1,), "skip_from": 0, "skip_to": 1,
              "parallel_start": 1, "paired_head_layers": (0,), "backout_layer": 1}
TWO_LAYER_FLAGS = [a for k, v in TWO_LAYERS.items()
                   for a in ("--" + k.replace("_", "-"), ",".join(map(str, v)) if isinstance(v, tuple) else str(v))]


def _parse(log_path):
    text = Path(log_path).read_text()
    steps, vals = {}, {}
    for line in text.splitlines():
        if line.startswith("step:"):
            m = compare.parse_step_line(line)
            assert m is not None, f"malformed step line: {line!r}"
            if "hellaswag_acc_norm" in m:  # an evaluation line (--hellaswag-every)
                continue
            if "val_loss" in m:
                vals[m["step"]] = m["val_loss"]
            else:
                steps[m["step"]] = m.get("train_loss")
    return text, steps, vals


# The shared smoke run's validations (and those of the runs compared with it, the same setting): on the CPU 8
# micro-batches (--val-tokens 2048, the fewest the check of the shard allows), not the smoke config's 16.
SMOKE_RUN_VAL = () if HAS_CUDA else ("--val-tokens", "2048")

# The tests of the shared smoke run carry this mark: one xdist worker builds it (where groups work: conftest.py).
on_smoke_run = pytest.mark.xdist_group("train_gpt_smoke_run")


@pytest.fixture(scope="module")
def smoke_run(smoke_data, tmp_path_factory):
    """One uninterrupted smoke run (10 steps, checkpoints at 5 and 10) shared by the tests below. Step 5 is
    the untie step, so the resume test also crosses the untie. Validations at steps 0, 4, 8, 10 (SMOKE_RUN_VAL)."""
    out = tmp_path_factory.mktemp("smoke_run")
    log_path, ckpt_dir = tg.main(_smoke_argv(smoke_data, out, "full", "--save-every", "5", *SMOKE_RUN_VAL))
    return out, Path(log_path), Path(ckpt_dir)


# ----------------------------------------------------------------------------------------------------
# End to end


@on_smoke_run
def test_smoke_loss_falls_and_log_parses(smoke_run):
    out, log_path, ckpt_dir = smoke_run
    text, steps, vals = _parse(log_path)
    hp = tg.smoke_hyperparameters()
    T = hp.total_steps
    # the code that ran, each file introduced by its marker, then the header, then the events
    for rel in ("train_gpt.py", "kernels/embedding.py", "kernels/polar_express.py", "data/shards.py"):
        assert f"# ===== file: {rel} =====" in text
    sections = text.split("\n" + "=" * 100 + "\n")
    assert len(sections) == 3, "expected source, header and events separated by two lines of 100 '='"
    header = dict(line.split(": ", 1) for line in sections[1].splitlines() if ": " in line)
    for key in ("git_sha", "python", "torch", "triton", "cuda", "gpu", "world_size", "corpus", "hyperparameters"):
        assert key in header, f"header lacks {key!r}"
    assert header["world_size"] == "1"
    assert json.loads(header["hyperparameters"])["num_layers"] == hp.num_layers
    assert re.search(r"^Running PyTorch \S+ compiled for CUDA \S+$", sections[1], re.M)
    assert re.search(r"\(val sha256\[:16\] [0-9a-f]{16}\)", header["corpus"])
    assert sorted(steps) == list(range(1, T + 1)), "one step line per step"
    assert sorted(vals) == [0, 4, 8, 10]
    assert all(float(v) > 0 for v in steps.values())
    first, last = float(vals[0]), float(vals[T])
    assert first > math.log(hp.vocab_size) - 0.5, "untrained loss should be near ln(vocab)"
    assert first - last > 1.5, f"val loss fell only from {first} to {last}"
    for key in ("tokens_per_s_per_gpu:", "mfu:", "compile_warmup_s:", "stage_step_avg:", "val_tokens_used:",
                "lm_head_matmul: ", "embedding_backward: " + ("added into" if HAS_CUDA else "dense gradient")):
        assert key in sections[2]
    assert sections[2].startswith(f"log_file: {log_path}\ncheckpoint_dir: {ckpt_dir}\n")
    assert "run_failed" not in sections[2]
    assert (ckpt_dir / "step_000005" / "rank0.pt").is_file()
    assert (ckpt_dir / "step_000010" / "rank0.pt").is_file()
    for s in (5, 10):  # each save's line: the folder, its size (rank 0's file alone at world size 1), the seconds
        mib = (ckpt_dir / f"step_{s:06d}" / "rank0.pt").stat().st_size / 2**20
        assert re.search(rf"^checkpoint_saved: {re.escape(str(ckpt_dir / f'step_{s:06d}'))} {mib:.0f} MiB in "
                         r"\d+\.\d s$", sections[2], re.M), s
    startup = re.search(r"^startup_s: (\S+) \(from (?:the launch|main) to the compile warmup: (.*)\)$", sections[2],
                        re.M)
    phases = dict(p.rsplit(" ", 1) for p in startup[2].split(", "))
    assert list(phases)[-6:] == ["process group", "shards and log", "compile cache", "parameters and model functions",
                                 "optimizer", "loaders"]
    assert list(phases)[:-6] == ["imports"]  # started by python, not torchrun (run_log.launch_phases)
    assert abs(sum(map(float, phases.values())) - float(startup[1])) <= 0.05 * len(phases) + 0.05
    assert sections[2].index("startup_s:") < sections[2].index("compile_warmup_s:")


# The process interrupted: it saves its step-5 checkpoint, says so and waits there for the test's SIGINT. It installs
# Python's SIGINT handler itself, as a process started from a terminal has it (a test runner may ignore SIGINT).
_WAIT_AFTER_STEP_5 = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import train_gpt as tg
save = tg.save_checkpoint
def save_then_wait(*args, **kwargs):
    path = save(*args, **kwargs)
    if path.name == "step_000005":
        print("saved step 5", flush=True)
        time.sleep(600)
    return path
tg.save_checkpoint = save_then_wait
tg.main(sys.argv[1:])
"""


@on_smoke_run
def test_ctrl_c_is_one_line_and_its_checkpoint_resumes_exactly(smoke_run, smoke_data, tmp_path):
    """Ctrl-C (SIGINT) in the smoke run's command right after its step-5 save: one line naming that checkpoint and
    how to resume, exit code 130, no traceback and no report of leaked objects from Triton's bindings at exit; its
    log ends with the same line as run_interrupted:. Resumed as the line says (the same command with --resume and,
    its --run-id being given, a new one; here also --save-every 2 --keep-last 1), the run reproduces the
    uninterrupted run's losses and final state bitwise (step 5 is the untie step: the resumed part starts by
    untying), keeps only its last checkpoint, names the run it continues (id and log) in its header, removes an
    unfinished save of that run (step_000010.tmp, made here as a kill during a save leaves it) and names another
    stopped run's, which it leaves alone."""
    _, log_full, ckpt_full = smoke_run
    _, steps_full, vals_full = _parse(log_full)
    # no validations in the interrupted part (the resumed run's are compared; val_every may differ on resume)
    argv = _smoke_argv(smoke_data, tmp_path, "cut", "--save-every", "5", "--val-every", "0", *SMOKE_RUN_VAL)
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_AFTER_STEP_5, *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line == "saved step 5\n":
                proc.send_signal(signal.SIGINT)
                break
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    ckpt = tmp_path / "ckpt" / "cut" / "step_000005"
    said = (f"interrupted at step 5/10; last checkpoint: {ckpt} (resume: the same command with --resume {ckpt} and "
            f"a new --run-id)")
    assert proc.returncode == 130, out[-3000:]
    assert out.endswith(f"saved step 5\ntrain_gpt.py: {said}\n"), out[-3000:]
    assert "Traceback" not in out and "leaked" not in out, out[-3000:]
    assert (tmp_path / "logs" / "cut.txt").read_text().splitlines()[-1] == f"run_interrupted: {said}"

    stale = ckpt.with_name("step_000010.tmp")
    stale.mkdir()
    (stale / "rank0.pt").write_bytes(b"half a file")
    other = tmp_path / "ckpt" / "other" / "step_000001.tmp"
    other.mkdir(parents=True)
    log2, ckpt2 = tg.main(_smoke_argv(smoke_data, tmp_path, "cut2", "--save-every", "2", "--resume", str(ckpt),
                                      "--keep-last", "1", *SMOKE_RUN_VAL))
    text, steps_res, vals_res = _parse(log2)
    assert tg.untie_step(tg.smoke_hyperparameters()) == 5
    assert sorted(steps_res) == list(range(6, 11))
    assert {s: steps_full[s] for s in steps_res} == steps_res, "train losses after Ctrl-C and resume differ"
    assert vals_res and {s: vals_full[s] for s in vals_res} == vals_res, "val losses after Ctrl-C and resume differ"
    assert [p.name for p in Path(ckpt2).iterdir()] == ["step_000010"]
    _assert_same_checkpoint(ckpt_full / "step_000010" / "rank0.pt", Path(ckpt2) / "step_000010" / "rank0.pt")
    header, events = text.split("\n" + "=" * 100 + "\n")[1:]
    assert f"\ncontinues: run cut (log {tmp_path / 'logs' / 'cut.txt'}) from {ckpt}, step 5\n" in header
    assert f"\nremoved_unfinished_save: {stale} (left by the run this one continues)\n" in events
    assert f"\nunfinished_saves: {other} (left by runs stopped while saving" in events
    assert not stale.exists() and other.exists()


def _assert_same_checkpoint(path_a, path_b, what="after resume"):
    """Two checkpoint files hold bitwise-equal parameters and optimizer state."""
    a, b = torch.load(path_a, weights_only=False), torch.load(path_b, weights_only=False)
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), f"final {k} differs {what}"
    for name, ga in a["optimizer"]["groups"].items():
        for key, t in ga.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, b["optimizer"]["groups"][name][key]), f"optimizer {name}.{key} differs {what}"


def _finish(proc, log_path, timeout=600):
    """Waits for a started run; returns its log path (the run's output in the failure message)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-6000:]
    return log_path


# The GPU runs of the compiled smoke model, run once per session for the tests below (tests/conftest.py).
on_gpu_runs = pytest.mark.xdist_group("train_gpt_gpu_runs")
GPU_STEPS, GPU_RESUME_AT = 40, 16  # the resumed part crosses stage 1's start (18) and the untie (before 19)


@pytest.fixture(scope="module")
def gpu_runs(shared_build):
    """Six runs of ``train_gpt.py --smoke --compile --deterministic`` on GPT-2-sized ids (vocabulary 50304, so the
    cross-entropy, embedding and optimizer kernels run at the speedrun's widths): 36 scheduled + 4 extension steps,
    through every batch-size stage (micro-batches of 128 then 256 tokens: two compiled shapes, plus validation) and the
    untie (before step 19), validation every 5 steps, the train loss logged at every step. The inductor and Triton
    caches are the fixture's own, empty at first. Run "a" first (it compiles: the same compiled region per
    micro-batch shape the speedrun uses), checkpoints every GPU_RESUME_AT (16) steps and at step 40; then, side by
    side, run "b" (the same command again, on a's caches, saving them with --compile-cache), run "resumed" (--resume
    a's step-16 checkpoint, steps 17 to 40) and run "other_paths" (a's command with the other embedding backward and
    kernel launches: --no-embed-grad-to-acc, the dense gradients folded by the hooks, and --cpp-wrapper, the
    compiled step's kernels launched from C++). Subprocesses: each run is a fresh process, as a real run and a
    real resume are. Run "opt_in", beside those, is a's command with every model flag beyond record #74 (off in the
    smoke config: OPT_IN_MODEL_FLAGS). Once b is done, run "cached" is a's command with empty caches of its own and
    a copy of b's --compile-cache in another folder (a fresh machine's start from a copied cache).
    Built once per session (conftest's shared_build: one xdist worker runs them, the others wait
    and read). Returns {run: (log text, train losses, val losses, final checkpoint path)}."""
    d = shared_build("train_gpt_gpu_runs", _gpu_runs)
    out = {}
    for run in ("a", "b", "resumed", "other_paths", "opt_in", "cached"):
        text, steps, vals = _parse(d / "logs" / f"{run}.txt")
        assert "compile_warmup_s:" in text and "recompiles_during_timed_run: 0" in text, run
        out[run] = (text, steps, vals, d / "ckpt" / run / f"step_{GPU_STEPS:06d}" / "rank0.pt")
    return out


def _gpu_runs(d):
    # the smoke data's learnable documents (ids below 511) after GPT-2's end-of-text id: the vocabulary is GPT-2's
    # (50304 rows, from the shards), and a run that learns shows it (uniform random ids would leave the loss at
    # ln 50256 = 10.8 whatever the model does)
    _make_shard(d / "det_train_000001.bin", 400_000, 1, bos=50256)
    _make_shard(d / "det_val_000000.bin", 40_000, 3, bos=50256)
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)  # an xdist worker's share (conftest): the run compiles alone
    env["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")  # run "a" compiles cold (its validation step aside)
    env["TRITON_CACHE_DIR"] = str(d / "triton")  # our kernels' binaries: what --compile-cache copies beside inductor's
    if _gpt2_cache_dir() is not None:  # run "opt_in"'s --prefix-loss reads them
        env["TIKTOKEN_CACHE_DIR"] = str(_gpt2_cache_dir())

    def start(run, *extra, caches=None):
        cmd = [sys.executable, str(REPO / "train_gpt.py"), "--smoke", "--compile", "--deterministic", "--train-loss",
               "--train-files", str(d / "det_train_*.bin"), "--val-files", str(d / "det_val_*.bin"),
               "--steps", str(GPU_STEPS - 4), "--extension-steps", "4", "--val-every", "5",
               "--run-id", run, "--log-dir", str(d / "logs"), "--checkpoint-dir", str(d / "ckpt"), *extra]
        run_env = env if caches is None else dict(env, TORCHINDUCTOR_CACHE_DIR=str(d / caches / "inductor"),
                                                  TRITON_CACHE_DIR=str(d / caches / "triton"))
        return subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    _finish(start("a", "--save-every", str(GPU_RESUME_AT)), None, timeout=900)
    b = start("b", "--compile-cache", str(d / "compile_cache"))
    resumed = start("resumed", "--resume", str(d / "ckpt" / "a" / f"step_{GPU_RESUME_AT:06d}"))
    other = start("other_paths", "--no-embed-grad-to-acc", "--cpp-wrapper")
    opt_in = start("opt_in", *OPT_IN_MODEL_FLAGS)
    _finish(b, None, timeout=900)
    # a copy elsewhere, as a user carries the folder to another machine: nothing in it may depend on its path
    shutil.copytree(d / "compile_cache", d / "moved_cache")
    cached = start("cached", "--compile-cache", str(d / "moved_cache"), caches="empty_caches")
    _finish(resumed, None, timeout=900)
    _finish(other, None, timeout=900)
    _finish(opt_in, None, timeout=900)
    _finish(cached, None, timeout=900)


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="--deterministic is a GPU promise (compiled model, Triton kernels)")
def test_deterministic_gpu(gpu_runs):
    """Two runs with --deterministic of the compiled smoke model (the gpu_runs fixture: runs "a" and "b"), 40 steps
    through every batch-size stage: bitwise-identical train_loss and val_loss in every line and bitwise-identical
    final weights. (The default model would spend minutes compiling; the code paths are the same.)"""
    (_, sa, va, ca), (_, sb, vb, cb) = gpu_runs["a"], gpu_runs["b"]
    assert sorted(sa) == list(range(1, GPU_STEPS + 1)) and all(v is not None for v in sa.values())
    assert sorted(va) == list(range(0, GPU_STEPS + 1, 5))
    assert sa == sb and va == vb, "loss lines differ between two --deterministic runs"
    pa = torch.load(ca, weights_only=False)["params"]
    pb = torch.load(cb, weights_only=False)["params"]
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"final {k} differs between two --deterministic runs"


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="the accumulate mode is a CUDA path (the CPU uses torch's embedding); "
                                         "tests/test_embedding.py checks its bits in the interpreter")
def test_embed_grad_paths_and_cpp_wrapper_change_no_bit_gpu(gpu_runs):
    """--embed-grad-to-acc (the default: the embedding backward adds into the optimizer's accumulators) promises
    the bits of --no-embed-grad-to-acc (the dense gradients folded by the hooks), and --cpp-wrapper (opt-in) those
    of Python launches (the default): run "a" against run "other_paths" (gpu_runs, the other path of each), both
    --deterministic, 40 steps across the untie and both batch-size stages: bitwise-identical train and val losses
    in every line, final weights and optimizer state. Each ran its path: the logs name them."""
    (text_a, sa, va, ca), (text, so, vo, co) = gpu_runs["a"], gpu_runs["other_paths"]
    hp = json.loads(next(line for line in text.splitlines() if line.startswith("hyperparameters: "))[17:])
    assert not hp["embed_grad_to_acc"] and hp["cpp_wrapper"], "the flags did not reach the run"
    assert "compile_options: train_step inductor options" in text, "the C++ launcher's options are not logged"
    assert "embedding_backward: added into the optimizer's fp32 accumulators" in text_a, "no accumulate mode"
    assert "embedding_backward: dense gradient, folded" in text, "the dense fold did not run"
    assert sorted(so) == sorted(sa) and sorted(vo) == sorted(va)
    assert so == sa and vo == va, "loss lines differ with --no-embed-grad-to-acc --cpp-wrapper"
    _assert_same_checkpoint(ca, co, what="with --no-embed-grad-to-acc --cpp-wrapper")


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="compilation runs on CUDA only")
def test_graphs_compiled_by_second_processes_are_cache_hits_gpu(gpu_runs):
    """Run "a" compiles cold (gpu_runs: an inductor cache of its own, empty): its first training graph (micro-batches
    of 128 tokens) misses the FX graph cache, and the graphs that second processes compiled meanwhile (compile_ahead,
    --deterministic passed on): the training step at 256 tokens on a GPU of AHEAD_TRAINING_GIB or more, and the
    validation step, are hits. A graph of a second process that differs from the run's (another setting, input or
    guard) would miss here too."""
    text = gpu_runs["a"][0]
    big = torch.cuda.get_device_properties(0).total_memory >= tg.AHEAD_TRAINING_GIB * 2**30
    done = re.findall(r"^compile_ahead: (.+): compiled by a second process, done \d+\.\d s after its start, "
                      r"waited for \d+\.\d s \(start \d+\.\d s, Trainer \d+\.\d s, step \d+\.\d s; "
                      r"frame (\w+) \[0/0\] ops \d+: .*; fx_graph_cache 0/(\d+) hits; aot_autograd_cache 0/1 hits\)$",
                      text, re.M)
    assert [(what, frame) for what, frame, n in done if int(n) > 0] == \
        ([("training step T=256", "train_step")] if big else []) + [("validation step", "val_step")], \
        [x for x in text.splitlines() if x.startswith("compile_ahead")]  # each compiled its graph cold, one frame
    frames = [(m[1], int(m[2]), int(m[3])) for m in re.finditer(
        r"^compile_report: frame (\w+) \[\S+\] .*; fx_graph_cache (\d+)/(\d+) hits", text, re.M)]
    train = [(h, n) for f, h, n in frames if f == "train_step"]
    assert len(train) == 2 and train[0][0] == 0 < train[0][1], frames
    assert train[1] == ((train[1][1], train[1][1]) if big else (0, train[1][1])) and train[1][1] > 0, frames
    assert [(h, n) for f, h, n in frames if f == "val_step"] == [(1, 1)], frames
    assert re.search(r"^compile_cache: cold$", text, re.M), "the run started cold: the second processes' hits aside"
    marked = re.findall(r"^compile_report: frame (\w+ \[\S+\]) .*; compiled by a second process$", text, re.M)
    assert marked == (["train_step [0/1]"] if big else []) + ["val_step [1/0]"], marked


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="compilation runs on CUDA only")
def test_a_warm_run_of_the_same_graphs_starts_no_second_processes_gpu(gpu_runs):
    """Runs "b" and "resumed" run on a's caches: a's compile warmup left its graphs' mark there, so neither starts a
    second process, and each says why. Every graph "resumed" compiles is an FX graph cache hit. Run "b" has an
    empty --compile-cache: its training and validation steps are compilation.Precompiled, each graph compiled
    ahead of time as a whole function and saved there (one line each, no frame compiled by dynamo's usual path).
    Run "a" itself (cold) started its second processes (test_graphs_compiled_by_second_processes_are_cache_hits_gpu)."""
    none = ["compile_ahead: none started: a run of these graphs finished its compile warmup with this inductor cache"]
    for run in ("b", "resumed"):
        text = gpu_runs[run][0]
        assert [x for x in text.splitlines() if x.startswith("compile_ahead")] == none, run
    hits = [(int(m[1]), int(m[2])) for m in re.finditer(r"^compile_report: frame .*; fx_graph_cache (\d+)/(\d+) hits",
                                                        gpu_runs["resumed"][0], re.M)]
    assert len(hits) == 3 and all(h == n > 0 for h, n in hits), hits
    text = gpu_runs["b"][0]
    saved = re.findall(r"^precompiled: (\w+) [0-9a-f]{16}: compiled and saved \d+\.\d MiB in \d+\.\d s "
                       r"\(fx_graph_cache \d+/\d+ hits\)$", text, re.M)
    assert sorted(set(saved)) == ["train_step", "val_step"] and saved.count("train_step") >= 2, \
        [x for x in text.splitlines() if x.startswith("precompiled")]
    assert not re.search(r"^compile_report: frame ", text, re.M), "a graph compiled outside Precompiled"
    assert re.search(r"^compile_cache: .+ \(--compile-cache \S+: empty: compiling\)$", text, re.M)
    assert re.search(r"^compile_cache_saved: \S+ \d+ MiB in \d+\.\d s$", text, re.M)
    assert "compiled ahead of time and kept whole in --compile-cache" in text, "the compile_options line says nothing"


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="compilation runs on CUDA only")
def test_compile_cache_loaded_into_empty_caches_loads_whole_functions_bitwise_gpu(gpu_runs):
    """Run "cached" starts with empty inductor and Triton caches of its own and loads a copy, in another folder, of
    the --compile-cache run "b" saved: the log says loaded, every whole function "b" saved is loaded (no dynamo
    trace, no frame compiled), the compiled mark came with the cache (no second process starts, and the log says
    why), and its losses and final weights are bitwise run "a"'s (--deterministic: the loaded graphs and kernels
    are the ones that ran there)."""
    text, steps, vals, ckpt = gpu_runs["cached"]
    saved = re.findall(r"^precompiled: (\w+ [0-9a-f]{16}): compiled and saved ", gpu_runs["b"][0], re.M)
    loaded = re.findall(r"^precompiled: (\w+ [0-9a-f]{16}): loaded \d+\.\d MiB in \d+\.\d s$", text, re.M)
    assert sorted(loaded) == sorted(saved) and saved, [x for x in text.splitlines() if x.startswith("precompiled")]
    assert re.search(rf"^compile_cache: loaded \S+moved_cache \(precompiled \({len(saved)} whole functions "
                     rf"loaded\)\)$", text, re.M), [x for x in text.splitlines() if x.startswith("compile_cache")]
    assert not re.search(r"^compile_report: frame ", text, re.M), "a graph compiled after all"
    assert [x for x in text.splitlines() if x.startswith("compile_ahead")] == [
        "compile_ahead: none started: a run of these graphs finished its compile warmup with this inductor cache"]
    _, steps_a, vals_a, ckpt_a = gpu_runs["a"]
    assert steps == steps_a and vals == vals_a
    pa, pc = torch.load(ckpt_a, weights_only=False)["params"], torch.load(ckpt, weights_only=False)["params"]
    assert all(torch.equal(pa[k], pc[k]) for k in pa)


# Every change beyond record #74 to the model, its loss and its optimizer at once (the smoke config has each off:
# the four the speedrun turns on by default, and the opt-in ones); --backout-layer 1: --mudd mixes that
# layer's output into the last two; four heads of 16: --muon-qk-pairs then splits W_q and W_k into two blocks each;
# --prefix-loss where tiktoken's gpt2 files are (its table is GPT-2's; the device machines' suite has them)
OPT_IN_MODEL_FLAGS = ("--one-stream", "--mudd", "--backout-layer", "1", "--xsa", "--mlp-act-only", "--muon-qk-pairs",
                      "--num-heads", "4", "--head-dim", "16", *(("--prefix-loss",) if _gpt2_cache_dir() else ()))


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="the opt-in forwards compiled for the GPU (fused MLP kernels, FlashAttention)")
def test_opt_in_model_flags_compile_and_train_gpu(gpu_runs):
    """Run "opt_in" (gpu_runs: every model flag beyond record #74, compiled, 40 steps through both batch-size
    stages): the flags reached the run, the training step compiled once per micro-batch shape with no recompile in
    the timed run (the fixture checks that line), the act-only MLP path ran, and it learned as run "a" did: every
    loss finite, the val loss down by more than 1.5 from step 0 (the CPU smoke test's bar) and within 0.5 of a's at
    step 40."""
    text, steps, vals = gpu_runs["opt_in"][:3]
    hp = json.loads(next(line for line in text.splitlines() if line.startswith("hyperparameters: "))[17:])
    assert hp["one_stream"] and hp["mudd"] and hp["xsa"] and hp["mlp_act_only"]
    assert hp["muon_qk_pairs"] and hp["num_heads"] == 4
    assert hp["prefix_loss"] == (_gpt2_cache_dir() is not None)
    assert hp["backout_layer"] == 1
    mlp_line = next(line for line in text.splitlines() if line.startswith("mlp: "))
    assert "relu(pre) = sqrt(act) in the backward" in mlp_line, mlp_line
    assert sorted(steps) == list(range(1, GPU_STEPS + 1)) and all(math.isfinite(float(v)) for v in steps.values())
    first, last = float(vals[0]), float(vals[GPU_STEPS])
    assert first - last > 1.5, (first, last)
    assert abs(last - float(gpu_runs["a"][2][GPU_STEPS])) < 0.5, (last, gpu_runs["a"][2][GPU_STEPS])


@on_gpu_runs
@pytest.mark.skipif(not HAS_CUDA, reason="resume on the GPU path (compiled, --deterministic); on the CPU "
                                         "test_ctrl_c_is_one_line_and_its_checkpoint_resumes_exactly checks the same")
def test_resume_gpu(gpu_runs):
    """GPU resume (the gpu_runs fixture): 40 steps straight (run "a") against 16 steps + --resume + 24 ("resumed",
    from a's step-16 checkpoint, in a new process), both --deterministic: bitwise-identical train and val losses
    after the resume, and bitwise-identical final weights and optimizer state (the resumed part crosses the untie
    before step 19 and two stage changes, at 18 and 36). The CPU equivalent, in the CPU suite:
    test_ctrl_c_is_one_line_and_its_checkpoint_resumes_exactly (eager smoke model, resume at the untie step)."""
    (_, sa, va, ca), (_, sr, vr, cr) = gpu_runs["a"], gpu_runs["resumed"]
    assert tg.untie_step(tg.smoke_hyperparameters(scheduled_steps=GPU_STEPS - 4)) > GPU_RESUME_AT
    assert sorted(sr) == list(range(GPU_RESUME_AT + 1, GPU_STEPS + 1)), "the resumed run starts after its checkpoint"
    assert {s: sa[s] for s in sr} == sr, "train losses after resume differ"
    assert vr and {s: va[s] for s in vr} == vr, "val losses after resume differ"
    _assert_same_checkpoint(ca, cr)


def test_trainer_draws_init_params_on_a_second_thread_with_the_serial_values(smoke_data, monkeypatch):
    """Trainer draws the parameters on a thread of its own while build_fns runs: the values are init_params' with
    the same seed drawn alone (its generator is its own; a draw from the global generator would differ here, since
    the main thread draws from it meanwhile), and an error in the thread reaches the caller."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), seed=3)
    cpu = Dist(device=torch.device("cpu"))
    real_init, real_build, threads = tg.init_params, tg.build_fns, []

    def init_params(*args):
        threads.append(threading.current_thread())
        return real_init(*args)

    def build_fns(*args, **kw):
        torch.rand(1000)  # the global generator moves while the parameters are drawn
        return real_build(*args, **kw)
    monkeypatch.setattr(tg, "init_params", init_params)
    monkeypatch.setattr(tg, "build_fns", build_fns)
    tr = tg.Trainer(hp, cpu, shard_files(hp.train_files), shard_files(hp.val_files))
    tr.loader.close()
    assert threads and threads[0] is not threading.main_thread()
    alone = real_init(hp, torch.device("cpu"), 3)
    assert list(tr.params) == list(alone)
    for k, v in alone.items():
        assert torch.equal(tr.params[k].detach(), v.detach()), k
        assert torch.equal(tr.initial[k], v.detach()), k
        assert tr.params[k].is_leaf and tr.params[k].requires_grad, k

    def broken(*args):
        raise RuntimeError("out of memory while drawing")
    monkeypatch.setattr(tg, "init_params", broken)
    with pytest.raises(RuntimeError, match="out of memory while drawing"):
        tg.Trainer(hp, cpu, shard_files(hp.train_files), shard_files(hp.val_files))


@pytest.mark.parametrize("graph", ["validation", "stage 1"])
def test_compile_ahead_process_runs_the_graph_as_the_run_does(smoke_data, graph, tmp_path):
    """compile_ahead, started as the run starts it (AHEAD_ENTRY in train_gpt.py's folder, the spec of ahead_spec on
    stdin), rebuilds the run's settings (HellaSwag off) and validates the micro-batch the compile warmup validates,
    or runs the training step the warmup runs first at stage 1's micro-batch length: its loss is bitwise the run's
    own (Trainer.validate(max_micro=1), or train_step at that step from the initial state)."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), seed=2, hellaswag_every=5)
    d = Dist(device=torch.device("cpu"))
    train_files, val_files = shard_files(hp.train_files), shard_files(hp.val_files)
    (_, first, T0), (_, step, T1) = tg.warmup_stages(hp)[:2]
    assert (first, T0) == (0, 128) and T1 == 256 and step > 0
    step = None if graph == "validation" else step
    spec = tg.ahead_spec(hp, types.SimpleNamespace(deterministic=True), d, train_files, val_files, step)
    rebuilt = checkpoints.saved_hyperparameters("spec", {"hyperparameters": json.loads(json.dumps(spec["hp"]))},
                                                tg.Hyperparameters, tg.Stage)
    assert rebuilt == dataclasses.replace(hp, hellaswag_every=0)
    assert spec["device"] == "cpu" and spec["deterministic"] is True and spec["step"] == step
    assert spec["precompiled"] is None  # no --compile-cache; with one, its folder (Trainer's precompiled)
    assert tg.ahead_spec(hp, types.SimpleNamespace(deterministic=True), d, train_files, val_files, step,
                         tmp_path / "aot")["precompiled"] == str(tmp_path / "aot")
    res = subprocess.run([sys.executable, "-c", tg.AHEAD_ENTRY], cwd=tg.HERE, input=json.dumps(spec), text=True,
                         capture_output=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    what = "validation" if step is None else f"training step {step}"
    ahead = float(re.search(rf"^compile_ahead: {what}: loss (\S+)$", res.stdout, re.M)[1])
    last = res.stdout.splitlines()[-1]  # its report for the run's log: seconds, no frames (the CPU runs eagerly)
    report = json.loads(last.removeprefix("compile_ahead_report: "))
    assert last.startswith("compile_ahead_report: ") and report["frames"] == [], last
    assert 0 < report["trainer_s"] and 0 < report["step_s"] and report["trainer_s"] + report["step_s"] <= \
        report["main_s"], report
    tr = tg.Trainer(dataclasses.replace(hp, hellaswag_every=0), d, train_files, val_files)
    try:
        if step is None:
            mine = tr.validate(tg.windows_at(hp, hp.total_steps - 1), max_micro=1)
        else:
            tr.loader.rewind(step)
            mine = tr.train_step(step, want_loss=True)
    finally:
        tr.loader.close()
    assert ahead == mine


def test_compile_ahead_starts_a_process_per_graph_unless_turned_off():
    """start_compile_ahead: one process per ahead_graphs entry, each with its spec, where the run compiles ahead;
    none with --no-compile-ahead, none where Compilation says no (no compilation, a loaded --compile-cache, the
    graphs marked compiled in this inductor cache: then, unless --no-compile-ahead, the log says why). Each spec
    names the run's folder of whole compiled functions (Compilation.precompiled: --compile-cache's, or None)."""
    hp, d = tg.Hyperparameters(), Dist(device=torch.device("cpu"))

    class Compiling:
        def __init__(self, ahead, marked=False):
            self.ahead, self.marked, self.started, self.lines = ahead, marked, [], []
            self.log = self.lines.append

        def compiles_ahead(self):
            return self.ahead

        def precompiled(self):
            return Path("cc/aot/k")

        def start_ahead(self, what, command, spec, cwd):
            self.started.append((what, command, spec["step"], cwd))
            assert spec["precompiled"] == str(Path("cc/aot/k"))
    args = types.SimpleNamespace(deterministic=False)
    on = Compiling(True)
    tg.start_compile_ahead(on, hp, args, d, ["t.bin"], ["v.bin"])
    assert on.started == [(name, [sys.executable, "-c", tg.AHEAD_ENTRY], step, tg.HERE)
                          for name, step in tg.ahead_graphs(hp, d.device)] and on.lines == []
    off = dataclasses.replace(hp, compile_ahead=False)
    why = "compile_ahead: none started: a run of these graphs finished its compile warmup with this inductor cache"
    for hp_, compiling, lines in ((off, Compiling(True), []), (hp, Compiling(False), []),
                                  (off, Compiling(False, True), []), (hp, Compiling(False, True), [why])):
        tg.start_compile_ahead(compiling, hp_, args, d, ["t.bin"], ["v.bin"])
        assert compiling.started == [] and compiling.lines == lines
    assert tg.parse_args(["--no-compile-ahead"], tg.Hyperparameters, tg.smoke_hyperparameters, "")[1].compile_ahead \
        is False


def test_graphs_key_follows_what_the_compiled_graphs_depend_on():
    """graphs_key: the same for settings no graph depends on (the files, the seed, logging and evaluation cadence,
    --no-compile-ahead itself); another for a model or schedule setting, --deterministic, or other code."""
    hp, d = tg.Hyperparameters(), Dist(device=torch.device("cpu"))
    args = types.SimpleNamespace(deterministic=False)
    key = tg.graphs_key(hp, args, d)
    assert re.fullmatch(r"[0-9a-f]{24}", key)
    same = dict(train_files="other_*.bin", val_files="v_*.bin", seed=7, val_every=10, save_every=5,
                log_train_loss=True, profile_steps=2, compile_ahead=False)
    for k, v in same.items():
        assert tg.graphs_key(dataclasses.replace(hp, **{k: v}), args, d) == key, k
    for k, v in dict(num_layers=hp.num_layers - 1, xsa=not hp.xsa, scheduled_steps=1000,
                     val_micro_tokens=hp.val_micro_tokens // 2).items():
        assert tg.graphs_key(dataclasses.replace(hp, **{k: v}), args, d) != key, k
    assert tg.graphs_key(hp, types.SimpleNamespace(deterministic=True), d) != key
    stamp = dict(tg.CompileCache.current_stamp(d.device), code="0" * 16)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tg.CompileCache, "current_stamp", staticmethod(lambda device: stamp))
        assert tg.graphs_key(hp, args, d) != key


def test_ahead_graphs_are_the_warmups_other_lengths_and_validation():
    """ahead_graphs: every training micro-batch length of the schedule but the warmup's first (warmup_stages: the
    schedule's order; the longest first with --dynamic-tokens, whose one graph leaves none), then validation; on
    the CPU (no memory bound) the training ones too."""
    hp = tg.Hyperparameters()
    stages = tg.warmup_stages(hp)
    assert [T for _, _, T in stages] == [16384, 32768, 49152]
    assert [s for _, s, _ in stages] == [0, 458, 917]
    cpu = torch.device("cpu")
    assert tg.ahead_graphs(hp, cpu) == [("training step T=32768", 458), ("training step T=49152", 917),
                                        ("validation step", None)]
    dyn = dataclasses.replace(hp, dynamic_tokens=True)
    assert [T for _, _, T in tg.warmup_stages(dyn)] == [49152, 32768, 16384]
    assert tg.ahead_graphs(dyn, cpu) == [("validation step", None)]
    # their compile_report frames: train_step's recompiles in the warmup's order, then val_step
    assert tg.ahead_frames(hp, [name for name, _ in tg.ahead_graphs(hp, cpu)]) == {
        "train_step [0/1]", "train_step [0/2]", "val_step [1/0]"}
    assert tg.ahead_frames(hp, ["training step T=49152"]) == {"train_step [0/2]"}
    assert tg.ahead_frames(dyn, ["validation step"]) == {"val_step [1/0]"}


def test_fp8_head_weights_are_made_once_per_step_from_the_current_head(smoke_data, monkeypatch):
    """With the FP8 head (forced on here), Trainer.train_step makes the head's e4m3 copies once per step, and every
    micro-step's head is handed the e4m3 copy of the head as it is then (torch's cast of lm_head / FP8_W_S, and its
    transpose): a copy kept from an earlier step, after the optimizer changed the head, fails here. The op itself is
    replaced by the reference CE of x @ lm_head (its math is tests/test_cross_entropy.py's; the interpreter would
    take minutes here)."""
    monkeypatch.setattr(tg, "fp8_head_support", lambda device: (True, "forced on for this test"))
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), param_dtype="bfloat16")
    tr = tg.Trainer(hp, Dist(device=torch.device("cpu")), shard_files(hp.train_files), shard_files(hp.val_files))
    assert tr.fns.head_path.startswith("fp8")
    made, seen = [], []
    real_weights = tg.fp8_head_weights

    def weights(w, w_s):
        made.append(w_s)
        if interpreting():
            return real_weights(w, w_s)
        # a GPU machine runs this CPU trainer without Triton's interpreter: torch's cast and copy stand in
        w8 = tg.fp8_e4m3(w.detach(), w_s)
        return Fp8Weights(w8, w8.T.contiguous())

    def head(x, w, x8, w8, w8t, targets, weights, x_s, w_s, grad_s, A, B, C, grad_s_div):
        assert torch.equal(x8.view(torch.uint8), (x.detach() / x_s).to(torch.float8_e4m3fn).view(torch.uint8))
        seen.append((w.detach().clone(), w8, w8t))
        return (tg.softcapped_cross_entropy_ref(x.float() @ w.float(), targets, weights, A, B, C),)
    monkeypatch.setattr(tg, "fp8_head_weights", weights)
    monkeypatch.setattr(tg, "fp8_head_ce", head)
    steps = 2
    heads = []
    for step in range(steps):
        heads.append(tr.params["lm_head"].detach().clone())
        tr.train_step(step, want_loss=False)
    tr.loader.close()
    assert len(seen) == steps * tg.SLOTS
    assert not torch.equal(heads[0], heads[1]), "the head did not change: the test would not see a stale copy"
    for i, (w, w8, w8t) in enumerate(seen):
        assert torch.equal(w, heads[i // tg.SLOTS]), f"micro-step {i}: the head changed within a step"
        want = (w / tg.FP8_W_S).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(w8.view(torch.uint8), want), f"micro-step {i}: w8 is not the current head's e4m3 copy"
        assert w8t.is_contiguous() and torch.equal(w8t.view(torch.uint8), want.T), f"micro-step {i}: w8t"
    assert made == [tg.FP8_W_S] * steps, f"{len(made)} preparations of the head's e4m3 copies in {steps} steps"


def test_trainer_reset_restores_initial_state(smoke_data, device):
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"))
    files = shard_files(hp.train_files)
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), files, shard_files(hp.val_files))
    tr.train_step(0, want_loss=False)
    tr.opt.untie()
    assert not torch.equal(tr.params["attn_bank"], tr.initial["attn_bank"])
    tr.reset()
    tr.loader.close()
    for k, v in tr.params.items():
        assert torch.equal(v, tr.initial[k]), k
    assert tr.opt.tied
    for g in tr.opt.groups.values():
        assert g.step == 0 and not g.acc.any()
        for key, t in g.state_tensors().items():
            if key != "master":
                assert not t.any(), f"{g.name}.{key} not reset"
        assert torch.equal(g.master, g.shard_of(g.param.detach()))
    assert tr.loader.state == {"shard": 0, "bos": 0, "epoch": 0, "step": 0}


def test_warmup_runs_the_untied_adam_update(smoke_data, device, monkeypatch):
    """The compile warmup reaches every launch of a run, the untied Adam update included (the embedding its own
    tensor in the bf16 launch): its untied step is a slow Adam step. The profile of 2026-11-25 showed a 342 ms gap
    before the first untied Adam kernel of a timed run, when the warmup's untied step (the extension's first, an
    even step) ran no Adam update. adam_every=2 as in the speedrun (the smoke schedule's 1 makes every step
    slow). Afterwards the state is the initial one again."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), adam_every=2, **TWO_LAYERS)
    assert not tg.slow_adam_step(hp, tg.stage_bounds(hp)[-1][0]), "the last stage must start on a fast step"
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), shard_files(hp.train_files),
                    shard_files(hp.val_files))
    updates = []
    real_adam = tr.opt._adam
    monkeypatch.setattr(tr.opt, "_adam", lambda items, lr_mul: (
        updates.append((tr.opt.tied, sorted(g.name for g, _ in items))), real_adam(items, lr_mul)))
    phases = tg.warmup(tr)
    assert any(not tied and "embed" in names and "lm_head" in names for tied, names in updates), updates
    untie_phase = [name for name, _ in phases if name.startswith("untie")]
    assert len(untie_phase) == 1 and tg.slow_adam_step(hp, int(untie_phase[0].split()[-1])), phases
    assert tr.opt.tied and all(g.step == 0 for g in tr.opt.groups.values())
    for k, v in tr.params.items():
        assert torch.equal(v, tr.initial[k]), k


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_tokens"])
def test_warmup_order_of_the_micro_batch_lengths(smoke_data, device, dynamic):
    """The warmup steps each micro-batch length once, the first stage's with and without the slow Adam groups (its
    steps 0 and 1 with adam_every=2); in the schedule's order by default, and with --dynamic-tokens the longest
    length first (the one graph compiles there: inductor's size hints and kernel choices are that length's). The
    smoke schedule's lengths: 128, then 256 (twice: the second stage and the extension)."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), adam_every=2,
                                  dynamic_tokens=dynamic, **TWO_LAYERS)
    bounds = tg.stage_bounds(hp)
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), shard_files(hp.train_files),
                    shard_files(hp.val_files))
    names = [name for name, _ in tg.warmup(tr) if name.startswith("stage")]
    first = ["stage0 T=128 step 0", "stage0 T=128 step 1"]
    second = [f"stage1 T=256 step {bounds[1][0]}"]
    assert names == (second + first if dynamic else first + second), names
    assert tr.opt.tied and all(g.step == 0 for g in tr.opt.groups.values())


def test_timed_loop_starts_its_clock_after_a_full_collection(smoke_data, tmp_path, monkeypatch):
    """Record #74 runs gc.collect() before its clock starts; ours also freezes what survives, so that a full
    collection during a timed step walks only the objects made since, and unfreezes at the end. Spec: cyclic
    garbage made as the timed run starts (Compilation.timed_run_starts) is gone by the first timed training step,
    the survivors are frozen then, and nothing is frozen after the run. The steps themselves do nothing here."""
    import gc
    import weakref

    class Cycle:
        pass
    alive = []

    def timed_run_starts(self, real=tg.Compilation.timed_run_starts):
        garbage = Cycle()
        garbage.me = garbage  # unreachable once the name is gone, but only a collection frees it
        alive.append(weakref.ref(garbage))
        return real(self)
    seen = []

    def train_step(self, step, want_loss, clock=None):
        if clock is not None:  # a timed step (the warmup's have no clock)
            seen.append((alive[0]() is None, gc.get_freeze_count()))
    monkeypatch.setattr(tg.Compilation, "timed_run_starts", timed_run_starts)
    monkeypatch.setattr(tg.Trainer, "train_step", train_step)
    monkeypatch.setattr(tg.Trainer, "validate", lambda *a, **k: 0.0)
    (tmp_path / "not_saved").mkdir()
    monkeypatch.setattr(tg, "save_checkpoint", lambda *a, **k: tmp_path / "not_saved")  # save_checkpoint's folder
    gc.unfreeze()
    try:
        tg.main(_smoke_argv(smoke_data, tmp_path, "gc", "--val-every", "0", *TWO_LAYER_FLAGS))
    finally:
        frozen_after = gc.get_freeze_count()
        gc.unfreeze()
    assert len(seen) == tg.smoke_hyperparameters().total_steps
    assert seen[0][0], "garbage made before the loop was still alive at the first timed step"
    assert seen[0][1] > 0, "nothing was frozen when the clock started"
    assert frozen_after == 0, "the loop left objects frozen"


def clock_journal(monkeypatch, hp):
    """A CPU trainer whose forward passes and backward passes go to FakeEvent's journal (test_run_log.py), so
    that the order of micro-batches and step-clock events can be read off it."""
    from test_run_log import FakeEvent
    FakeEvent.journal.clear()
    real_forward = tg.forward

    def forward(*args, **kwargs):
        loss = real_forward(*args, **kwargs)
        FakeEvent.journal.append(("forward", None))
        loss.register_hook(lambda g: FakeEvent.journal.append(("backward", None)))
        return loss
    monkeypatch.setattr(tg, "forward", forward)
    tr = tg.Trainer(hp, Dist(device=torch.device("cpu")), shard_files(hp.train_files),
                    shard_files(hp.val_files))
    return tr, FakeEvent


def test_train_step_waits_for_the_previous_step_once_its_first_micro_batch_is_queued(smoke_data, monkeypatch):
    """With the timed loop's clock, train_step blocks on the previous step's end event after its own first
    micro-batch's forward and backward are queued and before the second micro-batch's forward (so the device
    has that micro-batch to run while the host waits), records its own end event after its last micro-batch,
    and hands its loss to the clock: the same loss as train_step returns without a clock."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"))
    tr, Event = clock_journal(monkeypatch, hp)
    clock = run_log.StepClock(torch.device("cpu"), event=Event)
    clock.start()
    assert tr.train_step(0, True, clock=clock) is None and tr.train_step(1, True, clock=clock) is None
    clock.wait()
    kinds = [k for k, _ in Event.journal]
    one = ["forward", "backward"]
    assert kinds == (one * tg.SLOTS + ["record"] + one + ["sync"] + one * (tg.SLOTS - 1) + ["record", "sync"]), kinds
    records = [e for k, e in Event.journal if k == "record"]
    assert [e for k, e in Event.journal if k == "sync"] == records, "each step's own event waited for, in order"
    finished = clock.finished()
    assert [s for s, _, _ in finished] == [0, 1]
    tr.reset()
    assert [loss for _, _, loss in finished] == [tr.train_step(0, True), tr.train_step(1, True)]
    tr.loader.close()


def test_timed_loop_logs_each_step_once_the_device_finished_it(smoke_data, tmp_path, monkeypatch):
    """On a GPU a step's line is written once its end event is seen, during the next step (or at the clock's
    stop before a validation): the lines still come in step order, the validation line of step k right after
    step k's line, with the same train losses as the CPU's clock (a step finished when train_step returns), one
    step time per step, and times that never go back."""
    flags = ("--steps", "4", "--extension-steps", "1", "--val-every", "2", *TWO_LAYER_FLAGS)
    hp = _flags(["--smoke", *flags])[1]
    assert hp.log_train_loss and hp.total_steps > 2 * hp.val_every
    assert [end - start for start, end, _ in tg.stage_bounds(hp)] == [2, 2, 1]
    monkeypatch.setattr(tg.Trainer, "validate", lambda *a, **k: 0.0)

    def run(event):
        run_id = "events" if event else "cpu"
        monkeypatch.setattr(tg, "StepClock", lambda device, ms: run_log.StepClock(device, ms, event=event))
        footer = []
        monkeypatch.setattr(tg, "log_summary", lambda log, d, tokens, ms, stage_ms, weights: footer.append(stage_ms))
        log_path, _ = tg.main(_smoke_argv(smoke_data, tmp_path, run_id, *flags))
        return [line for line in Path(log_path).read_text().splitlines() if line.startswith("step:")], footer[0]

    from test_run_log import FakeEvent
    lines, stage_ms = run(FakeEvent)
    cpu_lines, _ = run(None)
    steps = [re.match(r"step:(\d+)/(\d+) (\w+):", line).groups() for line in lines]
    T = hp.total_steps
    expected = [("0", str(T), "val_loss")]
    for k in range(1, T + 1):
        expected += [(str(k), str(T), "train_time")] + ([(str(k), str(T), "val_loss")] if
                                                         k % hp.val_every == 0 or k == T else [])
    assert steps == expected
    assert sum(len(v) for v in stage_ms.values()) == T and all(x >= 0 for v in stage_ms.values() for x in v)
    times = [float(re.search(r"train_time:(\d+)ms", line)[1]) for line in lines if "train_time" in line]
    assert times == sorted(times)

    def losses(ls):
        return [line.split("train_loss:")[1] for line in ls if "train_loss:" in line]
    assert len(losses(lines)) == T and losses(lines) == losses(cpu_lines)


# ----------------------------------------------------------------------------------------------------
# Gradient accumulation


@pytest.mark.parametrize("on", [True, False])
def test_cpp_wrapper_reaches_the_training_steps_compile_only(monkeypatch, on):
    """--cpp-wrapper (opt-in) is inductor's cpp_wrapper option of the training step's torch.compile; validation (not
    timed) keeps the Python wrapper and its shorter compile. Without it (the default) no step passes any option
    beyond record #74's (fullgraph, static shapes). The log line names which."""
    assert tg.Hyperparameters().cpp_wrapper is False, "the default must pass no compile option beyond record #74's"
    calls = []
    monkeypatch.setattr(tg.torch, "compile", lambda f, **kw: calls.append((f.__name__, kw)) or f)
    fns = tg.build_fns(dataclasses.replace(tg.smoke_hyperparameters(), cpp_wrapper=on), torch.device("cpu"),
                       compile_model=True)
    train_options = ({"cpp_wrapper": True, "triton.store_cubin": True, "cpp_wrapper_build_separate": True}
                     if on else None)  # the default: record #74's options only (the public rules allow no others)
    assert calls == [("train_step", dict(fullgraph=True, dynamic=False, options=train_options)),
                     ("val_step", dict(fullgraph=True, dynamic=False, options=None))], calls
    assert ("--cpp-wrapper: opt-in" in fns.compile_path) == on and ("record #74's" in fns.compile_path) != on
    if on:
        with torch._inductor.config.patch(train_options):  # each one an option of this torch's inductor
            pass


@pytest.mark.parametrize("cpp", [False, True])
def test_compile_cache_makes_both_steps_precompiled_over_their_plain_compiles(monkeypatch, tmp_path, cpp):
    """With a folder for whole compiled functions (--compile-cache's, Compilation.precompiled), build_fns makes
    train_step and val_step compilation.Precompiled around the functions it would compile, with the plain
    torch.compile (the same options) as their fallback, keeping them in that folder; the log line says so. Without
    the folder the steps are the plain compiles, and without compilation the folder is not used."""
    calls = []
    monkeypatch.setattr(tg.torch, "compile", lambda f, **kw: calls.append((f.__name__, kw)) or (lambda *a: f))
    hp = dataclasses.replace(tg.smoke_hyperparameters(), cpp_wrapper=cpp)
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=True, precompiled=tmp_path / "aot")
    steps = (fns.train_step, fns.val_step)
    assert all(isinstance(s, compilation.Precompiled) for s in steps)
    assert [(s.name, s.fn.__name__, s.folder, s.options) for s in steps] == [
        ("train_step", "train_step", tmp_path / "aot", tg.cpp_wrapper_options() if cpp else None),
        ("val_step", "val_step", tmp_path / "aot", None)]
    assert [s.fallback() for s in steps] == [s.fn for s in steps]  # each fallback is torch.compile of its own fn
    assert [name for name, _ in calls] == ["train_step", "val_step"]
    assert "compiled ahead of time and kept whole in --compile-cache" in fns.compile_path
    plain = tg.build_fns(hp, torch.device("cpu"), compile_model=True)
    assert not isinstance(plain.train_step, compilation.Precompiled) and "kept whole" not in plain.compile_path
    eager = tg.build_fns(hp, torch.device("cpu"), compile_model=False, precompiled=tmp_path / "aot")
    assert eager.train_step.__name__ == "train_step" and eager.compile_path == "not compiled"


STEPS_SAVED_SCRIPT = r'''
import functools, hashlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
folder, layout = sys.argv[2], sys.argv[3]
# The eager backend: what is at stake here is dynamo's guards, saved with each function and rebuilt by the loading
# process; inductor would add a minute of C++ compiling per process and nothing to that.
torch.compile = functools.partial(torch.compile, backend="eager")
import compilation
import train_gpt as tg

features = dict(one_stream=True, mudd=True, xsa=True, backout_layer=0, num_heads=4, head_dim=16)
hp = tg.smoke_hyperparameters(**(features if layout == "default_features" else {}))
dev = torch.device("cpu")
g = torch.Generator().manual_seed(8)
ids = torch.randint(0, hp.bos_id, (256,), generator=g).to(torch.int32)
ids[0] = ids[100] = hp.bos_id
big = tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id)
mb = tg.MicroBatch(ids, torch.randint(0, hp.bos_id, (256,), generator=g), tg.prepare_ids(ids, hp.vocab_size),
                   bigram=big, bigram_prep=tg.prepare_ids(big, hp.bigram_vocab_size))
mtp = torch.tensor([1.0, 0.5, 0.25])


def losses_and_grads(compile_model):
    params = {k: v.detach().requires_grad_() for k, v in tg.init_params(hp, dev, 7).items()}
    fns = tg.build_fns(hp, dev, compile_model=compile_model, attention="dense", precompiled=folder)
    loss = tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=mtp)
    loss.backward()
    grads = [params[k].grad for k in sorted(params) if params[k].grad is not None]
    for p in params.values():
        p.grad = None  # as the trainer leaves them at validation (folded into its accumulators)
    with torch.no_grad():
        val = tg.forward(hp, params, fns, mb, (1, 2), {}, train=False)
    h = hashlib.sha256()
    for t in [loss.detach(), val] + grads:
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()


out = {"eager": losses_and_grads(False), "pre": losses_and_grads(True)}
out["entries"] = [e[:2] for e in compilation.PRECOMPILED]
print("RESULT " + json.dumps(out))
'''


@pytest.mark.parametrize("layout", ["record74", "default_features"])
def test_both_steps_saved_by_precompiled_load_whole_in_a_new_process(tmp_path, layout):
    """build_fns' train_step and val_step under --compile-cache (compilation.Precompiled; dynamo's eager backend
    here): a first process compiles each ahead of time and saves it, a second loads both files and no step falls
    back to the plain compile (a function whose guards cannot be rebuilt from its file, such as one reaching an
    object through two closures, would); the loss, the validation loss and every gradient are eager's bits in
    both. The smoke layout, and with the default's features (one stream, MUDD, XSA)."""
    def phase():
        r = subprocess.run([sys.executable, "-c", STEPS_SAVED_SCRIPT, str(REPO), str(tmp_path / "aot"), layout],
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-4000:]
        return json.loads(lines[0][7:])

    first, second = phase(), phase()
    assert [k for k, _ in first["entries"]] == ["compiled", "compiled"], first["entries"]
    assert sorted(x.split()[1] for _, x in first["entries"]) == ["train_step", "val_step"], first["entries"]
    assert [k for k, _ in second["entries"]] == ["loaded", "loaded"], second["entries"]
    assert first["pre"] == first["eager"] and second["pre"] == first["eager"], (first, second)


@pytest.mark.parametrize("accumulate", [False, True], ids=["dense_fold", "embed_grad_to_acc"])
def test_train_step_gradient_and_loss_are_the_global_batch_mean(small_vocab_data, device, accumulate):
    """Trainer.train_step at world size 1, fp32: the gradient it accumulates over the 8 micro-steps equals the
    gradient of the MEAN micro-batch loss over the global batch (autograd of that mean, computed here), and the
    train_loss it returns is that mean. At step 0 the near-uniform initial head puts it within 0.05 of ln(vocab)
    times the mean multi-token weight of a row
    (a loss scaled by 8, or summed instead of averaged, is off by a factor). World sizes 2, 4 and 8 compute
    world size 1's micro-gradients and losses (tests/test_world_sizes.py). Both embedding-gradient paths: the
    dense fold (--no-embed-grad-to-acc) and the accumulate mode (kernels.embedding's kernels, which the CPU runs
    through the interpreter here although the trainer gives the CPU torch's lookup). The reference gradient
    comes from the trainer's own lookup (torch's on the CPU: not the interpreted kernels a second time). The data
    and tables at vocabulary 128 (SMALL_VOCAB)."""
    data = small_vocab_data
    hp = tg.smoke_hyperparameters(param_dtype="float32", train_files=str(data / "smoke_train_*.bin"),
                                  val_files=str(data / "smoke_val_*.bin"), embed_grad_to_acc=accumulate,
                                  ve_tables=(0, 1, -1, 0), **SMALL_VOCAB)  # two value-embedding tables
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), shard_files(hp.train_files),
                    shard_files(hp.val_files))
    ref_fns = tr.fns
    if accumulate and device != "cuda":
        tr.fns = dataclasses.replace(tr.fns, lookup=tg.embedding, embed_accs=True)
    assert tr.fns.embed_accs == accumulate
    mbs = tr.loader.next()
    assert len(mbs) == tg.SLOTS
    tr.loader.rewind(0)
    names = list(tr.params)
    params = [tr.params[k] for k in names]
    windows = tg.windows_at(hp, 0)
    losses = [tg.forward(hp, tr.params, ref_fns, mb, windows, {}, train=True, mtp=tr.mtp[0]) for mb in mbs]
    with pytest.raises(AssertionError, match=r"forward\(train=True\) needs the step's multi-token weights"):
        tg.forward(hp, tr.params, ref_fns, mbs[0], windows, {}, train=True)
    mean = sum(losses) / len(losses)
    grads = dict(zip(names, torch.autograd.grad(mean, params, allow_unused=True)))
    accs = {}
    step = tr.opt.step

    started = set()

    def capture(*args, **kwargs):
        accs.update({k: g.acc[:g.rows].clone() for k, g in tr.opt.groups.items()})
        started.update(tr.opt.last.started)
        return step(*args, **kwargs)

    tr.opt.step = capture
    loss = tr.train_step(0, want_loss=True)
    tr.loader.close()
    assert abs(loss - mean.item()) <= 1e-5 * mean.item(), (loss, mean.item())
    # every due reduce-scatter was started inside the backward (embed is folded into lm_head while tied), but
    # with the accumulate mode (CUDA, --embed-grad-to-acc): the tables' (their accumulators are complete only after
    # the backward) and, while tied, the head's (step() first folds the embedding's accumulator into it)
    late = {"value_embeds", "bigram_embed", "lm_head"} if tr.fns.embed_accs else set()
    # (--xsa's alpha and --mudd's rows get no gradient with their flag off, so no hook starts their reduce-scatter:
    # step() does)
    assert started == set(tg.PARAMS) - {"embed"} - OPT_IN_PARAMS - late, started
    # multi-token loss: each row adds w_k * ln(vocab) for every k with t + k inside the micro-batch
    w, T = tg.mtp_weights_at(hp, 0), mbs[0].ids.numel()
    row_weight = sum(w[k] * (T - k) for k in range(len(w))) / T
    assert abs(mean.item() - row_weight * math.log(hp.vocab_size)) < 0.05, mean.item()
    # Tied at step 0. Without the accumulate mode the last micro-step's backward folds the embedding's gradient
    # into the head's (transposed) before starting the head's reduce-scatter, so the head's accumulator holds the
    # tied gradient when step() is called; with it, step() does that fold itself, so the head's accumulator still
    # holds the head's own gradient here (the fold in step() is checked bitwise against the other path by
    # test_embed_grad_paths_and_cpp_wrapper_change_no_bit_gpu).
    if not tr.fns.embed_accs:
        grads["lm_head"] = grads["lm_head"] + grads["embed"].T
    for k, g in grads.items():
        if g is None:
            continue
        scale = g.abs().max().item()
        if scale == 0:
            continue
        assert_close_report(accs[k].view_as(g), g, atol=1e-5 * scale, name=f"accumulated grad {k}")
    assert any(g is not None and g.abs().max() > 0 for g in grads.values())


OPT_IN_PARAMS = {"xsa_alpha", "mudd_w1", "mudd_w2", "mudd_bias"}  # read only with --xsa / --mudd


def _perturbed_params(hp, seed, device="cpu"):
    """init_params with the zero-initialised tensors filled, so every path of the forward matters."""
    p = tg.init_params(hp, torch.device("cpu"), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        p["mlp_bank"][1::2] = torch.randn(p["mlp_bank"][1::2].shape, generator=g) * hp.mlp_dim ** -0.5
        for k in ("attn_gate", "ve_gate", "smear_gate", "skip_gate", "bigram_embed"):
            p[k].copy_(torch.randn(p[k].shape, generator=g) * 0.3)
        p["x0_lambdas"].copy_(torch.rand(hp.num_layers, generator=g) * 0.5)
        p["resid_lambdas"].add_(torch.randn(p["resid_lambdas"].shape, generator=g) * 0.1)
        p["post_lambdas"].add_(torch.randn(p["post_lambdas"].shape, generator=g) * 0.1)
        p["scalars"] += 0.2  # attention lambdas, smear (0 at init: no smear gradient), backout, skip
        # --xsa's alphas and --mudd's W2 (zero at init) and bias; generators of their own, so the other tensors
        # keep their values
        p["xsa_alpha"].copy_(torch.randn(p["xsa_alpha"].shape, generator=torch.Generator().manual_seed(seed + 2)))
        g3 = torch.Generator().manual_seed(seed + 3)
        p["mudd_w2"].copy_(torch.randn(p["mudd_w2"].shape, generator=g3) * 0.3)
        p["mudd_bias"].add_(torch.randn(p["mudd_bias"].shape, generator=g3))
    return {k: v.detach().to(device).requires_grad_() for k, v in p.items()}


def _batch(hp, T, seed, n_docs):
    """(T,) ids starting with BOS and holding n_docs documents, targets, and the embedding prep."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hp.bos_id, (T,), generator=g, dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(T - 1, generator=g)[:n_docs - 1] + 1])
    ids[starts] = hp.bos_id
    targets = torch.randint(0, hp.vocab_size, (T,), generator=g)
    return ids, targets


@pytest.mark.parametrize("forward", ["lanes", "mudd"])
def test_gradient_accumulation_two_halves_equal_one_batch(device, forward):
    """fp32 model: two accumulated half-batch micro-steps (loss/2 each) vs one micro-step over the whole batch.
    The halves start with BOS, so the document mask separates them in the joint batch too; only the rotary
    positions differ (angles up to 256 rad in fp32: ~2^-24*256 = 1.5e-5 absolute), hence 2e-4 x max|grad|
    for the fp32 gradient buffers (a dropped or double-counted micro-step is a ~50% error). Every model feature
    is on, --xsa too: smear, key offset and the bigram hash do not read across a BOS, so the cut cannot matter.
    Two forwards: record #74's lanes, and one stream with --mudd (its backout layer moved before layer L-2), so
    that every parameter has a gradient in one of them (the rows of --mudd only in the second)."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", xsa=True)
    if forward == "mudd":
        hp = dataclasses.replace(hp, one_stream=True, mudd=True, backout_layer=1)
    T = 128
    ids, targets = _batch(hp, 2 * T, seed=5, n_docs=4)
    ids[T] = hp.bos_id
    ids, targets = ids.to(device), targets.to(device)
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    windows = (1, 2)
    runs = []
    for halves in (2, 1):
        params = _perturbed_params(hp, seed=3, device=device)
        opt = tg.Optimizer(hp, params, Dist(device=torch.device(device)))
        n = 2 * T // halves
        for h in range(halves):
            sl = slice(h * n, (h + 1) * n)
            prep = tg.prepare_ids(ids[sl].cpu().contiguous(), hp.vocab_size).to(device)
            mb = tg.MicroBatch(ids[sl].contiguous(), targets[sl].contiguous(), prep)
            loss = tg.forward(hp, params, fns, mb, windows, {}, train=False) / halves
            loss.backward()  # the optimizer's hooks fold the gradients into its accumulators
        accs = {k: g.acc.clone() for k, g in opt.groups.items()}
        opt.step(tg.step_plan(hp, 0), 1.0, 0.9)
        runs.append((params, accs))
    (p2, acc2), (p1, acc1) = runs
    for k in acc1:
        if k.startswith("mudd") and not hp.mudd:
            continue
        scale = acc1[k].abs().max().item()
        assert scale > 0, f"{k}: zero gradient, the test would not see a bug"
        assert_close_report(acc2[k], acc1[k], atol=2e-4 * scale, name=f"grad {k}")
    # Muon parameters after the step: the update is lr * O(1) per element, bf16 rounding of X inside the
    # momentum kernel may flip one ulp (2^-8) where the gradients differ slightly: bound lr * 2^-6.
    lr = hp.muon_lr * 2 * hp.mlp_proj_lr_mul  # the largest effective Muon lr (tall shape x2, W_proj x2)
    for k in ("attn_bank", "mlp_bank"):
        assert tg.PARAMS[k].optim == "muon"
        assert_close_report(p2[k], p1[k], atol=lr * 2 ** -6, name=f"param {k} after step")
        assert not torch.equal(p1[k], _perturbed_params(hp, seed=3, device=device)[k]), f"{k} did not move"


# ----------------------------------------------------------------------------------------------------
# Initialisation and the parameter table against record #74 (its GPT.__init__ and TrainingManager.param_table)

# Record #74's param_table for the Adam parameters, written out: name -> (lr_mul, betas, wd_mul). Our
# post_lambdas / x0_lambdas / resid_lambdas are its parameters of the same names; "scalars" holds its attention
# lambdas, smear, backout and skip lambdas (its "scalars"); attn_gate / ve_gate are its attn_gate_bank /
# ve_gate_bank (lr_mul and wd_mul default to 1.0 there).
RECORD_ADAM = {
    "scalars": (5.0, (0.9, 0.99), 0.0), "smear_gate": (0.01, (0.9, 0.99), 0.0),
    "skip_gate": (0.05, (0.9, 0.99), 0.0), "attn_gate": (1.0, (0.9, 0.99), 1.0), "ve_gate": (1.0, (0.9, 0.99), 1.0),
    "lm_head": (1.0, (0.5, 0.95), 150.0), "bigram_embed": (75.0, (0.75, 0.95), 5.0),
    "post_lambdas": (1.0, (0.9, 0.95), 0.0), "x0_lambdas": (1.0, (0.9, 0.95), 0.0),
    "bigram_lambdas": (1.0, (0.9, 0.95), 0.0), "resid_lambdas": (5.0, (0.9, 0.95), 0.0),
    "value_embeds": (75.0, (0.75, 0.95), 5.0), "embed": (1.0, (0.5, 0.95), 150.0),
}
# Our Adam rows beyond record #74's, the same way: --xsa's alpha, like the record's other per-layer scalar rows
# (post_lambdas, x0_lambdas, bigram_lambdas) and without decay; --mudd's, as record #81's param_table has its
# dense_w1 / dense_w2 (lr_mul 0.25, betas (0.9, 0.99), its default wd_mul 1) and dense_bs (no decay).
OURS_ADAM = {"xsa_alpha": (1.0, (0.9, 0.95), 0.0), "mudd_w1": (0.25, (0.9, 0.99), 1.0),
             "mudd_w2": (0.25, (0.9, 0.99), 1.0), "mudd_bias": (0.25, (0.9, 0.99), 0.0)}
ADAM_TABLE = RECORD_ADAM | OURS_ADAM


def test_parameter_table_is_the_records():
    assert {n for n, p in tg.PARAMS.items() if p.optim == "adam"} == set(ADAM_TABLE)
    for name, (lr_mul, betas, wd_mul) in ADAM_TABLE.items():
        p = tg.PARAMS[name]
        assert (p.lr_mul, tuple(p.betas), p.wd_mul) == (lr_mul, betas, wd_mul), name
    hp = tg.Hyperparameters()
    assert (hp.adam_lr, hp.adam_eps, hp.adam_wd, hp.adam_every) == (0.008, 1e-10, 0.005, 2)
    # what the compiled region reads: everything but the three tables the eager lookups read
    assert {n for n, p in tg.PARAMS.items() if not p.region} == {"embed", "value_embeds", "bigram_embed"}


def test_initialisation_is_the_records():
    """Record #74's GPT.__init__ on the default layer layout (11 layers, no attention in layer 6, two lanes from
    layer 7), at a small width and vocabulary: every attention matrix (W_o too) uniform with std 0.5/sqrt(C),
    W_fc uniform and W_proj zero, residual scales sqrt(1.1) per sublayer, output weights 1 but attention -> lane
    1 = 1.5 in parallel layers, x0 weights 0, bigram weights 0.05, attention lambdas (0.5, 1.0), smear 0, backout
    0.5, skip lambda -1.5, every gate zero, the head N(0, 0.005) tied to the embedding, value embeddings
    N(0, 0.01) in 5 tables at layers 1, 2, 8, 9, 10, a zero bigram table; softmax scale 0.1."""
    hp = dataclasses.replace(tg.Hyperparameters(), vocab_size=1024, bigram_vocab_size=640, model_dim=256,
                             num_heads=2, head_dim=128, mlp_dim=1024)
    assert hp.attn_scale == 0.1 and hp.ve_tables == (-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4)
    p = {k: v.detach().float() for k, v in tg.init_params(hp, torch.device("cpu"), seed=0).items()}
    C, L, n_attn = hp.model_dim, hp.num_layers, len(hp.attn_layers)
    assert n_attn == 10
    bound = 3 ** 0.5 * 0.5 / C ** 0.5 * (1 + 2 ** -8)  # the uniform's edge, plus the bf16 rounding of a value there
    attn = p["attn_bank"].view(n_attn, 4, C, C)
    for j in range(4):  # Q, K, V, O
        m = attn[:, j]
        assert m.abs().max() <= bound and abs(m.std().item() / (0.5 / C ** 0.5) - 1) < 0.02, j
    fc, proj = p["mlp_bank"].view(L, 2, hp.mlp_dim, C).unbind(1)
    assert fc.abs().max() <= bound and abs(fc.std().item() / (0.5 / C ** 0.5) - 1) < 0.02 and not proj.any()
    assert torch.equal(p["resid_lambdas"], torch.full((L, 2), 1.1 ** 0.5))
    post = torch.ones(L, 2, 2)
    post[7:, 0, 1] = 1.5
    assert torch.equal(p["post_lambdas"], post)
    assert not p["x0_lambdas"].any() and torch.equal(p["bigram_lambdas"], torch.full((L,), 0.05))
    assert torch.equal(p["scalars"], torch.tensor([0.5, 1.0] * n_attn + [0.0, 0.5, -1.5]))
    for k in ("smear_gate", "skip_gate", "attn_gate", "ve_gate", "bigram_embed"):
        assert not p[k].any(), k
    assert p["ve_gate"].shape == (5, hp.num_heads, 12) and p["attn_gate"].shape == (n_attn, hp.num_heads, 12)
    assert abs(p["lm_head"].std().item() / 0.005 - 1) < 0.02 and torch.equal(p["embed"], p["lm_head"].T)
    assert p["value_embeds"].shape == (5 * hp.vocab_size, C) and abs(p["value_embeds"].std().item() / 0.01 - 1) < 0.02


def test_adam_update_follows_the_table_with_cautious_decay(device):
    """Two optimizer steps on every Adam parameter (fp32, adam_every=1) against the record's Adam written in
    float64: per parameter its table row's lr (adam_lr * lr_mul * the schedule factor), betas and decay
    adam_wd * wd_mul * lr^2, bias-corrected moments, the decay applied only where the update shrinks the weight
    (cautious). Bound: a few fp32 roundings of |w| + lr per step. A wrong lr multiplier, beta or decay rule is off
    by far more (the value tables decay by 0.9% per step)."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", adam_every=1)
    params = _perturbed_params(hp, seed=21, device=device)
    opt = tg.Optimizer(hp, params, Dist(device=torch.device(device)))
    opt.untie()  # embed and lm_head step separately (tied, the head would take the embedding's gradient)
    untied = tg.step_plan(hp, 0)._replace(tied=False)
    gen = torch.Generator().manual_seed(22)
    spec = {}
    for k, (lr_mul, (b1, b2), wd_mul) in ADAM_TABLE.items():
        w = params[k].detach().double().cpu()
        spec[k] = dict(w=w, m=torch.zeros_like(w), v=torch.zeros_like(w), lr_mul=lr_mul, b1=b1, b2=b2, wd=wd_mul)
    shrunk = {}
    for t, factor in ((1, 1.0), (2, 0.7)):
        grads = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in params.items()}
        _feed(params, {k: g.to(device) for k, g in grads.items()}, params)
        opt.step(untied, factor, 0.9)
        for k, s in spec.items():
            g = grads[k].double()
            lr = hp.adam_lr * s["lr_mul"] * factor
            s["m"] = s["b1"] * s["m"] + (1 - s["b1"]) * g
            s["v"] = s["b2"] * s["v"] + (1 - s["b2"]) * g * g
            update = lr * (s["m"] / (1 - s["b1"] ** t)) / ((s["v"] / (1 - s["b2"] ** t)).sqrt() + hp.adam_eps)
            mask = (update * s["w"] > 0).double()
            shrunk[k] = mask.mean().item()
            s["w"] = s["w"] - update - mask * lr * lr * hp.adam_wd * s["wd"] * s["w"]
    for k, s in spec.items():
        bound = 16 * 2 ** -24 * (s["w"].abs().max().item() + hp.adam_lr * s["lr_mul"])
        assert_close_report(params[k], s["w"], atol=bound, name=f"{k} after two Adam steps")
    assert 0.1 < shrunk["value_embeds"] < 0.9  # the mask decides for a sizeable share of the elements


def test_xsa_alpha_steps_without_weight_decay(device):
    """--xsa's alpha takes the plain Adam step (lr_mul 1, betas (0.9, 0.95)) and no decay, even with a decay rate
    that would move it by 0.4% per step (adam_wd 10) where the cautious rule applies: alpha 0.5 and a positive
    gradient, so the step shrinks every element. Against Adam written in float64 (the same bound as the table's
    test); a decay of alpha would be off by ~2e-3, thousands of times the bound."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", adam_every=1, adam_wd=10.0, xsa=True)
    params = _perturbed_params(hp, seed=23, device=device)
    with torch.no_grad():
        params["xsa_alpha"].fill_(0.5)
    opt = tg.Optimizer(hp, params, Dist(device=torch.device(device)))
    gen = torch.Generator().manual_seed(24)
    w = torch.full(params["xsa_alpha"].shape, 0.5, dtype=torch.float64)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, factor in ((1, 1.0), (2, 0.7)):
        g = (torch.rand(w.shape, generator=gen) + 0.5) * 1e-2
        _feed(params, {"xsa_alpha": g.to(device)}, ["xsa_alpha"])
        opt.step(tg.step_plan(hp, t - 1), factor, 0.9)
        lr = hp.adam_lr * factor
        m, v = 0.9 * m + 0.1 * g.double(), 0.95 * v + 0.05 * g.double() ** 2
        w = w - lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + hp.adam_eps)
    assert_close_report(params["xsa_alpha"], w, atol=16 * 2 ** -24 * (0.5 + hp.adam_lr), name="alpha after two steps")


def test_without_xsa_alpha_is_in_the_table_and_the_checkpoint_and_stays_zero(smoke_data, device, tmp_path):
    """--no-xsa (the default): alpha is a parameter like any other (its PARAMS row, its optimizer group, its
    checkpoint key: the table and a checkpoint's keys do not depend on the flags), but the layers never read it, so
    it gets no gradient and two training steps leave it, its accumulator and its Adam moments zero."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"), adam_every=1)
    assert not hp.xsa and hp.xsa_layers == []
    d = Dist(device=torch.device(device))
    tr = tg.Trainer(hp, d, shard_files(hp.train_files), shard_files(hp.val_files))
    try:
        g = tr.opt.groups["xsa_alpha"]
        assert tr.params["xsa_alpha"].shape == (hp.num_layers, hp.num_heads) and not g.muon and g.slow
        for step in range(2):
            tr.train_step(step, want_loss=False)
    finally:
        tr.loader.close()
    assert not tr.params["xsa_alpha"].any() and not g.acc.any() and not g.exp_avg.any() and not g.exp_avg_sq.any()
    assert not torch.equal(tr.params["attn_bank"], tr.initial["attn_bank"])
    path = checkpoints.save_checkpoint(tmp_path, 2, tr.params, tr.opt, tr.loader.state, 0.0, d, hp)
    state = torch.load(path / "rank0.pt", weights_only=False)
    assert list(state["params"]) == list(tg.PARAMS) and list(state["optimizer"]["groups"]) == list(tg.PARAMS)
    assert state["hyperparameters"]["xsa"] is False and not state["params"]["xsa_alpha"].any()


def test_xsa_run_names_its_layers_in_the_log_and_trains_their_alphas(smoke_data, tmp_path):
    """A short --xsa run (two layers: layer 0 paired, layer 1 not): the header's hyperparameters say xsa true, a log
    line names the layers XSA acts on, and the final checkpoint's alpha moved in layer 1's row only."""
    log_path, ckpt_dir = tg.main(_smoke_argv(smoke_data, tmp_path, "xsa", *TWO_LAYER_FLAGS, "--xsa", "--steps", "2",
                                             "--extension-steps", "0", "--val-every", "0"))
    text = Path(log_path).read_text()
    header = text.split("\n" + "=" * 100 + "\n")[1]
    assert json.loads(header.split("hyperparameters: ", 1)[1].splitlines()[0])["xsa"] is True
    assert "\nxsa: layers 1 (the attention layers without paired heads)\n" in text
    alpha = torch.load(ckpt_dir / "step_000002" / "rank0.pt", weights_only=False)["params"]["xsa_alpha"]
    assert alpha.shape == (2, 2) and (alpha[1] != 0).all() and not alpha[0].any(), alpha


def _without_xsa(src, dst):
    """A copy of checkpoint folder src as a trainer from before --xsa wrote it: no xsa setting, no alpha."""
    dst.mkdir(parents=True)
    for f in src.glob("rank*.pt"):
        state = torch.load(f, weights_only=False)
        state["hyperparameters"].pop("xsa")
        state.get("params", {}).pop("xsa_alpha", None)
        state["optimizer"]["groups"].pop("xsa_alpha")
        state["optimizer"].get("acc", {}).pop("xsa_alpha", None)
        torch.save(state, dst / f.name)
    return dst


def test_checkpoint_from_before_xsa_resumes_bitwise_and_loads(tmp_path, device):
    """A checkpoint without --xsa's setting and alpha (checkpoints.ADDED_SETTINGS / ADDED_PARAMS): --resume reads it
    as --no-xsa (and refuses --xsa, naming it), load_checkpoint keeps alpha at its init and the optimizer's alpha
    group at its reset state, and the next steps are bitwise those from the full checkpoint; load_model (--sample,
    --hellaswag) gives alpha zero. A checkpoint lacking any other parameter is refused in one line."""
    hp = tg.smoke_hyperparameters(adam_every=2)
    dev = Dist(device=torch.device(device))
    gen = torch.Generator().manual_seed(7)
    pa = _perturbed_params(hp, seed=3, device=device)
    with torch.no_grad():
        pa["xsa_alpha"].zero_()  # what a --no-xsa run's alpha is
    names = [k for k in pa if k != "xsa_alpha"]  # without --xsa no gradient reaches alpha
    grads = [{k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device, v.dtype) for k, v in pa.items()}
             for _ in range(3)]
    a = tg.Optimizer(hp, pa, dev)
    _feed(pa, grads[0], names)
    a.step(tg.step_plan(hp, 0), 1.0, 0.9)
    full = checkpoints.save_checkpoint(tmp_path / "run", 1, pa, a, {"step": 1}, 0.0, dev, hp)
    old = _without_xsa(full, tmp_path / "old" / "step_000001")
    checkpoints.check_resume(hp, old, dev)
    with pytest.raises(checkpoints.CheckpointError, match="--xsa is False in the checkpoint, True in this run"):
        checkpoints.check_resume(dataclasses.replace(hp, xsa=True), old, dev)
    runs = []
    for path in (full, old):
        params = _perturbed_params(hp, seed=4, device=device)  # other values: all must come from the checkpoint ...
        with torch.no_grad():
            params["xsa_alpha"].zero_()  # ... but alpha, whose init (zero) stays where the checkpoint lacks it
        opt = tg.Optimizer(hp, params, dev)
        checkpoints.load_checkpoint(path, params, opt, dev)
        for step in (1, 2):
            _feed(params, grads[step], names)
            opt.step(tg.step_plan(hp, step), 1.2, 0.9)
        runs.append(params)
    for k in pa:
        assert torch.equal(runs[0][k], runs[1][k]), f"{k} differs after resuming from the checkpoint without XSA"
    assert not runs[1]["xsa_alpha"].any()
    hp_old, params_old, _ = tg.load_model(old, dev)
    assert hp_old.xsa is False and not params_old["xsa_alpha"].any()
    assert params_old["xsa_alpha"].shape == (hp.num_layers, hp.num_heads)
    state = torch.load(old / "rank0.pt", weights_only=False)
    state["params"].pop("smear_gate")
    broken = tmp_path / "broken" / "step_000001"
    broken.mkdir(parents=True)
    torch.save(state, broken / "rank0.pt")
    with pytest.raises(checkpoints.CheckpointError, match="no parameter 'smear_gate' in the checkpoint"):
        checkpoints.load_checkpoint(broken, _perturbed_params(hp, seed=4, device=device), opt, dev)


# ----------------------------------------------------------------------------------------------------
# Adam every other step (the parameter table's slow rows)


def test_slow_adam_schedule():
    hp = tg.Hyperparameters(adam_every=2)
    assert [s for s in range(10) if tg.slow_adam_step(hp, s)] == [1, 3, 5, 7, 9]
    # The last step always updates the slow groups. Record #82's 1385 steps end on an even step, 1384: a slow step
    # only for being the last, right after 1383's (on its one step's gradients). Record #74's 1490 end on an odd one.
    assert [s for s in range(1380, 1385) if tg.slow_adam_step(hp, s)] == [1381, 1383, 1384]
    rec74 = dataclasses.replace(hp, scheduled_steps=1450, extension_steps=40)
    assert [s for s in range(1485, 1490) if tg.slow_adam_step(rec74, s)] == [1485, 1487, 1489]
    assert [s for s in range(7) if tg.slow_adam_step(dataclasses.replace(hp, adam_every=3), s)] == [2, 5]
    assert all(tg.slow_adam_step(dataclasses.replace(hp, adam_every=1), s) for s in range(10))
    # record #74 steps every Adam parameter on the odd steps only (its _is_adam_step), the banks every step
    adam = {"scalars", "resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas", "smear_gate", "skip_gate",
            "attn_gate", "ve_gate", "lm_head", "value_embeds", "bigram_embed", "embed", "xsa_alpha", "mudd_bias",
            "mudd_w2", "mudd_w1"}
    smoke = tg.smoke_hyperparameters()
    groups = tg.Optimizer(smoke, tg.init_params(smoke, torch.device("cpu"), 0), Dist()).groups
    assert {n for n, g in groups.items() if g.slow} == adam
    assert {n for n, g in groups.items() if g.muon} == {"attn_bank", "mlp_bank"}


def test_step_plan_follows_the_schedule_and_the_parameter_table():
    """The optimizer's plan of a step for the speedrun's schedule (adam_every=2; the untie after the first slow
    Adam step of stage 2, the odd step 917 of record #82's schedule): the Muon banks step every step, the Adam rows
    at the odd steps and the last (1384, even), in PARAMS order; the head is tied up to step 917; in the last
    backward every row that steps starts its reduce-scatter but the embedding while tied (its gradient goes into
    the head's), and with the accumulate mode (--embed-grad-to-acc, CUDA) but the three tables and, while tied, the
    head (it waits for the embedding's)."""
    hp = tg.Hyperparameters()
    muon = {"attn_bank", "mlp_bank"}
    adam = {"scalars", "resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas", "smear_gate", "skip_gate",
            "attn_gate", "ve_gate", "lm_head", "value_embeds", "bigram_embed", "embed", "xsa_alpha", "mudd_bias",
            "mudd_w2", "mudd_w1"}
    tables = {"embed", "value_embeds", "bigram_embed"}
    for step, slow, tied in ((0, False, True), (1, True, True), (916, False, True), (917, True, True),
                             (918, False, False), (919, True, False), (1382, False, False), (1383, True, False),
                             (1384, True, False)):
        for accs in (False, True):
            plan = tg.step_plan(hp, step, accs)
            assert plan.tied == tied, (step, accs)
            assert set(plan.groups) == muon | (adam if slow else set()), (step, accs)
            assert list(plan.groups) == [n for n in tg.PARAMS if n in plan.groups]
            late = (tables if accs else set()) | (({"embed"} | ({"lm_head"} if accs else set())) if tied else set())
            assert plan.early == set(plan.groups) - late, (step, accs)


def _feed(params, grads, names):
    """Gradients given by hand, through autograd: the optimizer's hooks fold them into its accumulators."""
    torch.autograd.backward([params[k] for k in names], [grads[k].clone() for k in names])


def spec_normuon_step(w, g, mom, v2, mu, lr, beta2, wd):
    """One NorMuon step of one matrix in float64, written out (record #74's Muon: Nesterov momentum, Polar Express,
    the per-row or, for a wide matrix, per-column second moment, the renorm to the orthogonal factor's Frobenius
    norm, cautious decay); mom and v2 in place, returns the new w."""
    mom.mul_(mu).add_((1 - mu) * g)
    u = (1 - mu) * g + mu * mom
    o = polar_express_ref((u / (u.norm() * 1.02))[None], normalized=True)[0]  # the reference iteration, float64
    red = -1 if o.shape[0] >= o.shape[1] else -2
    v2.mul_(beta2).add_((1 - beta2) * o.square().mean(dim=red, keepdim=True))
    upd = o / v2.clamp_min(1e-10).sqrt()
    upd = upd * o.norm() / upd.norm()
    return w - lr * (upd + ((upd * w) >= 0) * w * wd)


def test_muon_qk_pairs_orthogonalises_each_pair_of_heads_of_w_q_and_w_k():
    """--muon-qk-pairs (public record #80): two Muon steps of attn_bank ([W_q, W_k, W_v, W_o] per attention layer)
    against spec_normuon_step in float64, applied to each (2 head_dim, C) block of rows of every W_q and W_k (heads
    2j and 2j + 1: block j) and to each W_v and W_o whole, with its own momentum and second moment. Bound: lr x
    2^-5 per element (the trainer's momentum output and Polar Express run in bf16); a whole-matrix step of W_q
    misses it by far, and W_v / W_o get exactly the default optimizer's bits."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", num_heads=4, head_dim=16, muon_qk_pairs=True)
    H, D, C = hp.num_heads, hp.head_dim, hp.model_dim
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(len(hp.attn_layers) * 4, C, C, generator=gen) * 1e-2 for _ in range(2)]
    runs = {}
    for pairs in (True, False):
        h = dataclasses.replace(hp, muon_qk_pairs=pairs)
        params = tg.init_params(h, torch.device("cpu"), 0)
        w0 = params["attn_bank"].detach().double().clone()
        opt = tg.Optimizer(h, params, Dist())
        for step, grad in enumerate(grads):
            _feed(params, {"attn_bank": grad}, ["attn_bank"])
            opt.step(tg.step_plan(h, step), 1.0, 0.9)
        runs[pairs] = params["attn_bank"].detach().double()
    lr, mu = hp.muon_lr, 0.9
    expected = w0.clone()
    for m in range(w0.shape[0]):
        blocks = [slice(2 * D * j, 2 * D * (j + 1)) for j in range(H // 2)] if m % 4 < 2 else [slice(0, C)]
        for rows in blocks:
            w, mom = w0[m, rows].clone(), torch.zeros_like(w0[m, rows])
            M, N = w.shape
            v2 = torch.zeros((M, 1) if M >= N else (1, N), dtype=torch.float64)
            for grad in grads:
                w = spec_normuon_step(w, grad[m, rows].double(), mom, v2, mu, lr, hp.muon_beta2, hp.muon_wd * lr)
            expected[m, rows] = w
    err = (runs[True] - expected).abs().max().item()
    assert err <= lr * 2 ** -5, err
    qk = torch.tensor([m % 4 < 2 for m in range(w0.shape[0])])
    assert (runs[False][qk] - expected[qk]).abs().max().item() > 8 * lr * 2 ** -5, "a whole-matrix step passes"
    assert torch.equal(runs[True][~qk], runs[False][~qk]), "W_v / W_o changed"


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untie_between"])
def test_slow_adam_groups_step_on_the_summed_gradient(untie, device, monkeypatch):
    """fp32 params, two steps with adam_every=2: step 0 leaves the slow groups' params and state alone and keeps
    their gradient; step 1 updates them once (Adam step count 1, step 1's lr) on the fp32 sum of both steps'
    gradients. The specification: a second optimizer fed that sum directly (while tied, the embedding's gradient
    of step 0 folded into the head's, transposed: what a tied step does), stepped once; bitwise equal.
    Muon steps at both steps, and so does an Adam row marked slow=False (the table's other cadence: here
    attn_gate, set so for the test)."""
    monkeypatch.setitem(tg.PARAMS, "attn_gate", dataclasses.replace(tg.PARAMS["attn_gate"], slow=False))
    hp = tg.smoke_hyperparameters(param_dtype="float32", adam_every=2)
    dev = Dist(device=torch.device(device))
    gen = torch.Generator().manual_seed(11)
    pa = _perturbed_params(hp, seed=3, device=device)
    pb = _perturbed_params(hp, seed=3, device=device)
    g0 = {k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device) for k, v in pa.items()}
    g1 = {k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device) for k, v in pa.items()}
    a, b = tg.Optimizer(hp, pa, dev), tg.Optimizer(hp, pb, dev)
    slow = [k for k, g in a.groups.items() if g.slow]
    assert "attn_gate" not in slow and {"scalars", "embed", "lm_head", "value_embeds"} <= set(slow)
    start = {k: v.detach().clone() for k, v in pa.items()}
    _feed(pa, g0, pa)
    a.step(tg.step_plan(hp, 0), 1.0, 0.9)
    assert a.pending
    for k in slow:
        assert torch.equal(pa[k], start[k]), f"{k} moved at a skipped step"
        assert a.groups[k].step == 0 and not a.groups[k].exp_avg.any()
        assert torch.equal(a.groups[k].acc[:a.groups[k].rows], g0[k]), f"{k}: gradient not kept"
    for k in ("attn_gate", "attn_bank", "mlp_bank"):
        assert not torch.equal(pa[k], start[k]), f"{k} should step every step"
    if untie:
        a.untie()
    _feed(pa, g1, pa)
    plan = tg.step_plan(hp, 1)._replace(tied=not untie)
    a.step(plan, 1.3, 0.9)
    assert not a.pending

    summed = {k: g0[k] + g1[k] for k in slow}
    if untie:  # the tied step-0 embedding gradient belongs to the head
        summed["lm_head"] = (g0["lm_head"] + g0["embed"].T) + g1["lm_head"]
        summed["embed"] = g1["embed"].clone()
        b.untie()
    _feed(pb, summed, slow)
    b.step(plan, 1.3, 0.9)
    for k in slow:
        assert torch.equal(pa[k], pb[k]), f"{k} differs from one step on the summed gradient"
        for key, t in a.groups[k].state_tensors().items():
            assert torch.equal(t, b.groups[k].state_tensors()[key]), f"{k}.{key}"
        assert a.groups[k].step == b.groups[k].step == (0 if k == "embed" and a.tied else 1)
        assert not a.groups[k].acc.any()


def test_world_size_1_updates_the_parameters_in_place(device):
    """At world size 1 a rank's shard is the whole parameter: the kernels write each parameter that has a master
    (the bf16 matrices, the banks) in place, where they wrote a buffer that the gather then copied into it. The
    specification is that copying optimizer (its shard buffers restored): the same parameters and optimizer state,
    bit for bit, over tied steps (a slow one moves the head and, by its transpose, the embedding, whose own master
    stays behind), a state_dict round trip (which must leave the parameters alone), the untie and untied steps;
    after each step every parameter written in place but the tied embedding holds its master rounded."""
    hp = tg.smoke_hyperparameters(adam_every=2)  # bf16 matrices with fp32 masters, fp32 scalars and gates
    dev = Dist(device=torch.device(device))
    pa, pb = _perturbed_params(hp, seed=5, device=device), _perturbed_params(hp, seed=5, device=device)
    a, b = tg.Optimizer(hp, pa, dev), tg.Optimizer(hp, pb, dev)
    for g in b.groups.values():
        g.in_place = False
        g.sync_shard_param()
    written = {n for n in pa if tg.PARAMS[n].matrix}
    assert written >= {"attn_bank", "mlp_bank", "lm_head", "embed", "value_embeds", "bigram_embed"}
    for n, g in a.groups.items():
        shares = g.shard_param.data_ptr() == pa[n].data_ptr()
        assert shares == (n in written), f"{n}: shard_param {'is not' if n in written else 'is'} the parameter"
    gen = torch.Generator().manual_seed(6)
    for step in range(4):
        if step == 2:
            before = {k: v.detach().clone() for k, v in pa.items()}
            a.load_state_dict(a.state_dict())
            for k, v in pa.items():
                assert torch.equal(v, before[k]), f"load_state_dict changed {k}"
            a.untie()
            b.untie()
        grads = {k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device=device, dtype=v.dtype)
                 for k, v in pa.items()}
        for opt, params in ((a, pa), (b, pb)):
            _feed(params, grads, params)
            opt.step(tg.step_plan(hp, step)._replace(tied=step < 2), 1.0, 0.9)
        for n, g in a.groups.items():
            assert torch.equal(pa[n], pb[n]), f"{n} after step {step}"
            for key, t in g.state_tensors().items():
                assert torch.equal(t, b.groups[n].state_tensors()[key]), f"{n}.{key} after step {step}"
            if n in written and not (n == "embed" and a.tied):
                assert torch.equal(pa[n], g.master[:g.rows].to(pa[n].dtype)), f"{n} is not its master rounded"
        if a.tied:
            assert torch.equal(pa["embed"], pa["lm_head"].T)
    assert not torch.equal(pa["lm_head"], before["lm_head"]) and not torch.equal(pa["embed"], before["embed"])


def test_embedding_accs_stay_the_accumulators(device):
    """Optimizer.embedding_accs() is made once and reused every micro-step, so its views must keep pointing at
    the accumulators themselves through reset(), untie(), a step and load_state_dict() (which copies into them):
    an accumulator replaced by a new tensor would leave the lookups adding into a stale buffer."""
    hp = tg.smoke_hyperparameters(vocab_size=512, bos_id=511, ve_tables=(0, 1, -1, 0), adam_every=2)
    params = tg.init_params(hp, torch.device(device), seed=0)
    opt = tg.Optimizer(hp, params, Dist(device=torch.device(device)))
    accs = opt.embedding_accs()

    def check(when):
        g = opt.groups
        assert opt.embedding_accs() is accs, when
        for name in ("embed", "bigram_embed"):
            a = accs[name]
            assert a.data_ptr() == g[name].acc.data_ptr() and a.shape == (g[name].rows, hp.model_dim), (when, name)
        ve = g["value_embeds"].acc
        for i, a in enumerate(accs["value_embeds"]):
            assert a.data_ptr() == ve[i * hp.vocab_size].data_ptr() and a.shape == (hp.vocab_size, hp.model_dim)
        for name in ("embed", "value_embeds", "bigram_embed"):  # writes through the views reach the buffers
            g[name].acc.zero_()
        accs["embed"][3].fill_(1.0)
        accs["value_embeds"][-1][5].fill_(2.0)
        assert g["embed"].acc[3].eq(1.0).all(), when
        assert g["value_embeds"].acc[(hp.num_ve - 1) * hp.vocab_size + 5].eq(2.0).all(), when

    def step(plan):
        _feed(params, {k: torch.ones_like(p) for k, p in params.items()}, params)
        opt.step(plan, 1.0, 0.9)

    check("new")
    step(tg.step_plan(hp, 0))  # no slow Adam step: their accumulators pending, part of the state
    sd = opt.state_dict()
    assert set(sd["acc"]) >= {"embed", "value_embeds", "bigram_embed"}
    opt.reset()
    check("after reset")
    opt.untie()
    check("after untie")
    step(tg.step_plan(hp, 1)._replace(tied=False))
    check("after a step")
    opt.load_state_dict(sd)
    check("after load_state_dict")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embed_grad_to_acc_is_bitwise_the_dense_fold(tied, small_vocab_data, device):
    """--embed-grad-to-acc against the default, through Trainer.train_step: with the embedding lookups adding
    into the optimizer's accumulators, every accumulator, parameter and optimizer state is bitwise what the dense
    gradients folded by the hooks give. Both trainers use kernels.embedding.embedding (on the CPU: the Triton
    interpreter; the CPU trainer's own torch lookup has no accumulate mode, so build_fns leaves the flag off
    there), bf16 tables, two value-embedding tables (views of one parameter and one accumulator), and two of each
    step's eight micro-batches (the interpreter's cost; the loss is still scaled by 1/8). adam_every=2: the first
    step leaves the tables' accumulators pending, the second reduces and updates them, while tied (steps 0 and 1:
    the head's reduce-scatter then waits for step(), which folds the embedding's accumulator into it) or untied
    (--untie-stage 0: steps 2 and 3, the first of which unties). The data and tables at vocabulary 128
    (SMALL_VOCAB: a quarter of the interpreted programs)."""
    data = small_vocab_data
    hp = tg.smoke_hyperparameters(train_files=str(data / "smoke_train_*.bin"), val_files=str(data / "smoke_val_*.bin"),
                                  adam_every=2, ve_tables=(0, 1, -1, 0), untie_stage=1 if tied else 0, **SMALL_VOCAB)
    steps = (0, 1) if tied else (2, 3)
    assert tg.untie_step(hp) == (6 if tied else 2) and [tg.slow_adam_step(hp, s) for s in steps] == [False, True]
    tables = {"embed", "value_embeds", "bigram_embed"}

    def same_bits(a, b):  # bitwise, -0.0 and NaN payloads included
        ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
        return a.dtype == b.dtype and torch.equal(a.detach().view(ints[a.dtype]), b.detach().view(ints[b.dtype]))

    trainers = []
    for on in (False, True):
        tr = tg.Trainer(dataclasses.replace(hp, embed_grad_to_acc=on), Dist(device=torch.device(device)),
                        shard_files(hp.train_files), shard_files(hp.val_files))
        assert tr.fns.embed_accs == (on and device == "cuda")
        assert tr.fns.embed_path.startswith("added into" if on and device == "cuda" else "dense gradient")
        tr.fns = dataclasses.replace(tr.fns, lookup=tg.embedding, embed_accs=on)
        next_step = tr.loader.next
        tr.loader.next = lambda next_step=next_step: next_step()[:2]
        tr.loader.rewind(steps[0])
        started = []
        step = tr.opt.step

        def capture(*args, tr=tr, step=step, started=started, **kwargs):
            started.append(set(tr.opt.last.started))
            assert all(tr.params[k].grad is None for k in tables)
            return step(*args, **kwargs)

        tr.opt.step = capture
        trainers.append((tr, started))
    (off, started_off), (on, started_on) = trainers
    for step in steps:
        for tr, _ in trainers:
            tr.train_step(step, want_loss=False)
            assert tr.opt.tied == tied
        for name, g in off.opt.groups.items():
            h = on.opt.groups[name]
            assert same_bits(on.params[name], off.params[name]), f"step {step}: parameter {name}"
            assert same_bits(h.acc, g.acc), f"step {step}: accumulator {name}"
            for key, t in g.state_tensors().items():
                assert same_bits(h.state_tensors()[key], t), f"step {step}: {name}.{key}"
            assert g.step == h.step
        assert on.opt.pending == off.opt.pending == (step == steps[0])
        if step == steps[0]:  # the tables' gradients are pending, and nonzero (the test would see a dropped one)
            assert all(off.opt.groups[k].acc.any() for k in tables)
    for tr, _ in trainers:
        tr.loader.close()
    assert all(not torch.equal(off.params[k], off.initial[k]) for k in tables | {"lm_head"})
    # Who started the due reduce-scatters at the slow step: the hooks for every table in the default mode
    # (while tied the embedding's is the head's); step() for the tables with the flag (and the head while tied).
    # (--xsa's alpha and --mudd's rows get no gradient with their flag off, so no hook starts their reduce-scatter:
    # step() does)
    region = set(tg.PARAMS) - tables - {"lm_head"} - OPT_IN_PARAMS
    assert started_off[1] == region | {"lm_head"} | tables - ({"embed"} if tied else set())
    assert started_on[1] == region | (set() if tied else {"lm_head"})


@pytest.mark.parametrize("qk_pairs", [False, True], ids=["default", "muon_qk_pairs"])
def test_checkpoint_between_slow_adam_steps_resumes_bitwise(tmp_path, device, qk_pairs):
    """A checkpoint after a skipped step carries the slow groups' pending gradients (per rank): a fresh
    optimizer loaded from it (through save_checkpoint / load_checkpoint) ends the next step bitwise equal to
    the uninterrupted one; without the pending gradients the slow groups would differ. With --muon-qk-pairs (four
    heads) the W_q / W_k blocks' momentum and second moment come back too."""
    hp = tg.smoke_hyperparameters(adam_every=2)
    if qk_pairs:
        hp = dataclasses.replace(hp, muon_qk_pairs=True, num_heads=4, head_dim=16)
    dev = Dist(device=torch.device(device))
    gen = torch.Generator().manual_seed(5)
    pa = _perturbed_params(hp, seed=3, device=device)
    grads = [{k: (torch.randn(v.shape, generator=gen) * 1e-2).to(device, v.dtype) for k, v in pa.items()}
             for _ in range(2)]
    a = tg.Optimizer(hp, pa, dev)
    _feed(pa, grads[0], pa)
    a.step(tg.step_plan(hp, 0), 1.0, 0.9)
    path = checkpoints.save_checkpoint(tmp_path, 1, pa, a, {"step": 1}, 0.0, dev, hp)
    pb = _perturbed_params(hp, seed=4, device=device)  # other values: everything must come from the checkpoint
    b = tg.Optimizer(hp, pb, dev)
    checkpoints.load_checkpoint(path, pb, b, dev)
    assert b.pending and torch.equal(b.groups["embed"].acc, a.groups["embed"].acc)
    if qk_pairs:
        assert torch.equal(b.groups["attn_bank"].mom_blocks, a.groups["attn_bank"].mom_blocks)
        assert b.groups["attn_bank"].mom_blocks.any() and b.groups["attn_bank"].v2_blocks.any()
    for opt, params in ((a, pa), (b, pb)):
        _feed(params, grads[1], params)
        opt.step(tg.step_plan(hp, 1), 1.2, 0.9)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"{k} differs after resuming between slow Adam steps"


# ----------------------------------------------------------------------------------------------------
# Profiling (--profile-steps)


def test_profile_steps_smoke_writes_table_and_leaves_the_run_unchanged(smoke_data, tmp_path):
    """--profile-steps 1 on a 2-step smoke run (two layers, two stages of one step): a trace per stage and a table in
    the log, then the same loss lines as the same run without profiling (the profiled steps are followed by a
    reset)."""
    short = ("--steps", "2", "--extension-steps", "0", "--val-every", "0", *TWO_LAYER_FLAGS)
    log_ref, _ = tg.main(_smoke_argv(smoke_data, tmp_path, "noprof", *short))
    log2, _ = tg.main(_smoke_argv(smoke_data, tmp_path, "prof", *short, "--profile-steps", "1"))
    _, steps_ref, vals_ref = _parse(log_ref)
    text, steps, vals = _parse(log2)
    events = text.split("\n" + "=" * 100 + "\n")[-1]  # after the source dump and the header
    for i in (0, 1):
        assert f"profile_stage{i}: steps {i}..{i}, trace " in events
        assert (Path(log2).parent / f"prof_profile_stage{i}_rank0.json").is_file()
    assert "profile_stage2" not in events, "the empty extension stage is not profiled"
    assert events.count("  by category: ") == 2 and events.count(" idle ") == 2
    assert sorted(steps) == [1, 2] and sorted(vals) == [2]
    if not HAS_CUDA:
        assert steps == steps_ref and vals == vals_ref, "profiling changed the run"
    else:  # one launch probe per micro-batch length, in stage order, before the profiled steps
        probes = re.findall(r"^launch_probe: stage(\d) T=(\d+): host (\S+) ms to queue one micro-batch's forward "
                            r"and backward, device (\S+) ms to run them$", events, re.M)
        hp = tg.smoke_hyperparameters()  # stages 0 and 1: micro-batches of 128 and 256 tokens
        assert [(int(i), int(T)) for i, T, _, _ in probes] == [(0, hp.stages[0].batch_tokens // tg.SLOTS),
                                                                (1, hp.stages[1].batch_tokens // tg.SLOTS)]
        assert all(float(h) > 0 and float(dev) > 0 for _, _, h, dev in probes)
        assert events.index("launch_probe: stage1") < events.index("profile_stage0:")


def test_launch_probes_take_the_first_step_of_each_micro_batch_length_then_reset():
    """Spec: stages in order; a stage whose micro-batch length an earlier stage had, or with no steps, is not
    probed again; each probe is one line with the stage, the length and both times; then one full reset."""
    stages = (tg.Stage(0.25, 1024, (1, 1), 1.0, 96), tg.Stage(0.5, 1024, (1, 2), 1.0, 96),
              tg.Stage(1.0, 2048, (1, 2), 1.0, 192), tg.Stage(None, 2048, (2, 2), 1.0, 192))
    hp = tg.smoke_hyperparameters(stages=stages, scheduled_steps=8, extension_steps=2)
    calls = []
    trainer = types.SimpleNamespace(hp=hp, launch_probe=lambda step: calls.append(step) or (1.25, 3.5),
                                     reset=lambda: calls.append("reset"))
    lines = []
    tg.launch_probes(trainer, lines.append)
    assert calls == [0, 4, "reset"]
    assert lines == ["launch_probe: stage0 T=128: host 1.2 ms to queue one micro-batch's forward and backward, "
                     "device 3.5 ms to run them",
                     "launch_probe: stage2 T=256: host 1.2 ms to queue one micro-batch's forward and backward, "
                     "device 3.5 ms to run them"]


@pytest.mark.skipif(not HAS_CUDA, reason="the launch probe holds and times a CUDA device")
def test_launch_probe_times_the_host_and_the_device_apart(smoke_data):
    """Spec of Trainer.launch_probe: one micro-batch's forward and backward, host time = the wall time to queue
    them, device time = from the device's first to its last kernel of them. Without a hold the device waits on the
    host, so its time is at least the host's (its end event is queued after the host's clock stops, so a host
    descheduled meanwhile cannot make the host's time the longer); with the device
    held busy meanwhile, the hold is not counted (the smoke model runs in far less than the 300 ms hold). The
    gradient lands in the accumulators, and the probe leaves the parameters as they were."""
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"))
    tr = tg.Trainer(hp, Dist(device=torch.device("cuda")), shard_files(hp.train_files), shard_files(hp.val_files))
    before = {k: v.detach().clone() for k, v in tr.params.items()}
    host, device = tr.launch_probe(0, hold_ms=0.0)
    assert host > 0 and device >= host - 0.5, (host, device)
    host, device = tr.launch_probe(0, hold_ms=300.0)
    assert host > 0 and 0 < device < 150.0, (host, device)
    assert all(torch.equal(before[k], v) for k, v in tr.params.items())
    assert any(g.acc.abs().sum() > 0 for g in tr.opt.groups.values())
    tr.loader.close()


# ----------------------------------------------------------------------------------------------------
# Flat forward vs a plain reference


# The record #74 features (tests/test_model.py), all off: the base model.
NO_FEATURES = {f: False for f in ("bigram", "paired_heads", "mtp", "smear", "yarn", "key_offset", "backout",
                                  "fp8_head", "attn_lambdas")}


def test_flat_forward_matches_reference(device):
    """fp32 flat forward vs the specification (tests/test_model.py's spec_forward) in float64 (rule 1: at most 2x
    the specification's own fp32 error), and the validation loss. Dense attention on both devices (the
    FlashAttention op is checked against it separately). The record #74 features are off here (the base model);
    tests/test_model.py checks each of them."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", **NO_FEATURES)
    params = _perturbed_params(hp, seed=11, device=device)
    ids, targets = _batch(hp, 384, seed=12, n_docs=5)
    windows = (1, 2)
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    with torch.no_grad():
        mb = tg.MicroBatch(ids.to(device), targets.to(device))
        x = fns.layers(*tg.model_inputs(hp, params, fns, mb, windows, {}))
        ours = tg.head_logits(x, params["lm_head"], hp.softcap).cpu()
        ours_loss = tg.forward(hp, params, fns, mb, windows, {}, train=False).cpu()
        P64 = {k: v.detach().cpu().double() for k, v in params.items()}
        P32 = {k: v.detach().cpu().float() for k, v in params.items()}
        ref64 = spec_forward(hp, P64, ids, windows)
        ref32 = spec_forward(hp, P32, ids, windows)
    assert ours.dtype == torch.float32
    assert_matches_torch(ours, ref64, ref32, name="logits")
    loss64 = F.cross_entropy(ref64, targets)
    assert_matches_torch(ours_loss, loss64, F.cross_entropy(ref32, targets), name="loss")


def test_flat_forward_long_window_and_documents_matter(device):
    """The reference comparison above must be sensitive: a different window or no document mask changes it."""
    hp = tg.smoke_hyperparameters(param_dtype="float32")
    params = _perturbed_params(hp, seed=11, device=device)
    ids, _ = _batch(hp, 384, seed=12, n_docs=5)
    ids = ids.to(device)
    fns = tg.build_fns(hp, torch.device(device), compile_model=False)
    with torch.no_grad():
        base = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), (1, 2), {}))
        wider = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), (2, 3), {}))
        one_doc = ids.clone()
        one_doc[1:][one_doc[1:] == hp.bos_id] = 0
        merged = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(one_doc), (1, 2), {}))
    assert (base - wider).abs().max() > 1e-3
    assert (base - merged).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# Document boundaries and the GPU attention op


def test_doc_cu_seqlens_are_the_bos_positions():
    """Documents start at position 0 and at every later BOS; a leading partial document (no BOS at 0, as in a
    validation chunk) counts as one; the last entry is the length. The dense mask built from doc_ids agrees."""
    ids = torch.tensor([7, 7, 9, 511, 3, 511, 511, 4, 4], dtype=torch.int32)
    assert tg.doc_cu_seqlens(ids, 511).tolist() == [0, 3, 5, 6, 9]
    assert tg.doc_cu_seqlens(ids[3:], 511).tolist() == [0, 2, 3, 6]
    assert tg.doc_cu_seqlens(np.array([511, 1, 2]), 511).tolist() == [0, 3]
    assert tg.doc_cu_seqlens(ids, 511).dtype == torch.int32
    cu = tg.doc_cu_seqlens(ids, 511)
    docs = tg.doc_ids(ids, 511)
    same = docs[:, None] == docs[None, :]
    spans = torch.zeros(9, 9, dtype=torch.bool)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        spans[a:b, a:b] = True
    assert torch.equal(same, spans)


def test_loader_document_boundaries_follow_its_documents(smoke_data):
    """The training loader's cu_seqlens are doc_cu_seqlens of its ids: every slot starts with a BOS, and no document
    is longer than max_doc_len (the bound the FlashAttention grid uses)."""
    hp = tg.smoke_hyperparameters()
    files = shard_files(smoke_data / "smoke_train_*.bin")
    ld = tg.TrainLoader(hp, files, Dist(), lambda s: 256)
    for step in range(hp.total_steps):  # both document cuts of the smoke stages (96, then 192 tokens)
        for mb in ld.next():
            assert int(mb.ids[0]) == hp.bos_id
            assert torch.equal(mb.cu_seqlens, tg.doc_cu_seqlens(mb.ids, hp.bos_id))
            assert int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()) <= mb.max_len
            assert mb.max_len == tg.stage_at(hp, step)[1].max_doc_len
    ld.close()


@pytest.mark.skipif(not HAS_CUDA, reason="FlashAttention runs on CUDA only")
@pytest.mark.parametrize("window", [128, 384, 1664])
def test_flash_attend_matches_dense_on_gpu(window):
    """The GPU attention op (speedrun::doc_attention: FlashAttention varlen over our document boundaries, the
    window read from a CPU tensor) vs SDPA with the dense mask, forward and backward, bf16, rule 1 against
    float64; documents of 1 to ~900 tokens, some longer than the window; and the interleaved 2T sequence of
    paired heads (documents twice as long)."""
    T, H, D = 2048, 6, 128
    g = torch.Generator().manual_seed(window)
    ids = torch.randint(0, 50000, (T,), generator=g, dtype=torch.int32)
    ids[torch.randperm(T, generator=g)[:9]] = 50256
    ids[[0, 1000, 1001]] = 50256
    dev = torch.device("cuda")
    cu = tg.doc_cu_seqlens(ids, 50256).to(dev)
    docs = tg.doc_ids(ids.to(dev), 50256)
    win = torch.tensor(window)
    for paired in (False, True):
        n = 2 * T if paired else T
        seq = tg.DocSeq(2 * cu if paired else cu, docs.repeat_interleave(2) if paired else docs, 2 * T if paired else T)
        h = H // 2 if paired else H
        qkv = [torch.randn(n, h, D, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(3)]
        y = tg.flash_attend(*qkv, seq, win, 0.12)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, qkv, dy)
        q64 = [t.detach().double().requires_grad_() for t in qkv]
        y64 = tg.dense_attend(*q64, seq, window, 0.12)
        g64 = torch.autograd.grad(y64, q64, dy.double())
        y_lp = tg.dense_attend(*qkv, seq, window, 0.12)
        g_lp = torch.autograd.grad(y_lp, qkv, dy)
        assert_matches_torch(y, y64, y_lp, name=f"attention out w={window} paired={paired}")
        for name, a, e, l in zip("qkv", grads, g64, g_lp):
            assert_matches_torch(a, e, l, name=f"attention d{name} w={window} paired={paired}")


@pytest.mark.skipif(not HAS_CUDA, reason="FlashAttention runs on CUDA only")
def test_flash_attend_reads_strided_views_without_copies():
    """q, k, v as views of one (T, 3, H, D) buffer (what a layer without a value embedding hands the op): the
    forward and backward run no more copies (aten::clone / aten::copy_, the ops inside the custom ops included,
    as the profiler records them) than with contiguous inputs, give the same bits (out, dk, dv; dq too under
    deterministic algorithms), and the grads come back contiguous (T, H, D), as the op's fake says."""
    T, H, D = 3000, 6, 128
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50000, (T,), generator=g, dtype=torch.int32)
    ids[[0, 700, 2900]] = 50256
    dev = torch.device("cuda")
    seq = tg.DocSeq(tg.doc_cu_seqlens(ids, 50256).to(dev), None, T)
    base = torch.randn(T, 3, H, D, generator=g).to(dev, torch.bfloat16)
    dy = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16)

    def run(fused):
        """(out, grads, the copy ops recorded, every op name recorded) for one forward and backward."""
        leaf = base.clone().requires_grad_() if fused else [t.contiguous().requires_grad_() for t in base.unbind(1)]
        qkv = leaf.unbind(1) if fused else leaf
        assert fused != qkv[2].is_contiguous()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = tg.flash_attend(*qkv, seq, torch.tensor(384), 0.12)
            grads = torch.autograd.grad(y, qkv, dy)
        names = [e.name for e in prof.events()]
        return y, grads, [n for n in names if n in ("aten::clone", "aten::copy_")], names

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        y, grads, copies, names = run(fused=True)
        y_sep, grads_sep, copies_sep, _ = run(fused=False)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert "aten::_flash_attention_forward" in names and "aten::_flash_attention_backward" in names, names
    assert len(copies) <= len(copies_sep), (copies, copies_sep)
    assert torch.equal(y, y_sep)
    for name, a, b in zip("qkv", grads, grads_sep):
        assert a.shape == (T, H, D) and a.is_contiguous(), name
        assert torch.equal(a, b), f"d{name}"


@pytest.mark.skipif(not HAS_CUDA, reason="FlashAttention runs on CUDA only")
def test_flash_attend_backward_is_deterministic_when_asked():
    """Under torch.use_deterministic_algorithms (what --deterministic turns on, warn_only), the attention
    backward gives the same bits twice (FlashAttention's default accumulates dq with atomics)."""
    T, H, D = 4096, 6, 128
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50000, (T,), generator=g, dtype=torch.int32)
    ids[[0, 2000]] = 50256
    dev = torch.device("cuda")
    seq = tg.DocSeq(tg.doc_cu_seqlens(ids, 50256).to(dev), None, T)
    qkv = [torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16).requires_grad_() for _ in range(3)]
    dy = torch.randn(T, H, D, generator=g).to(dev, torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [torch.autograd.grad(tg.flash_attend(*qkv, seq, torch.tensor(1664), 0.12), qkv, dy) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def _python_calls(kernel, op, *args):
    """Names of the Python functions that run during op(*args), not counting those called inside ``kernel`` (a
    function: the op's kernel)."""
    names, inside = [], []

    def profile(frame, event, arg):
        if event == "call" and not inside:
            names.append(frame.f_code.co_name)
            if frame.f_code is kernel.__code__:
                inside.append(frame)
        elif event == "return" and inside and frame is inside[0]:
            inside.clear()

    sys.setprofile(profile)
    try:
        op(*args)
    finally:
        sys.setprofile(None)
    return names


def _dense_attention_grads(dy, q, k, v, docs, window, scale):
    """(dq, dk, dv) of dense attention within the documents ``docs`` ((T,) document index per position) over the
    window, written out in fp32 (a stand-in kernel runs below autograd), each contiguous in q's dtype."""
    T = q.shape[0]
    qf, kf, vf, dyf = (t.float().transpose(0, 1) for t in (q, k, v, dy))  # (H, T, D)
    rel = torch.arange(T)[:, None] - torch.arange(T)[None]
    mask = (rel >= 0) & (rel < window) & (docs[:, None] == docs[None])
    p = torch.softmax((qf @ kf.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")), -1)
    dp = dyf @ vf.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    grads = scale * ds @ kf, scale * ds.transpose(1, 2) @ qf, p.transpose(1, 2) @ dyf
    return tuple(t.transpose(0, 1).to(q.dtype).contiguous() for t in grads)


def test_attention_ops_plumbing_with_cpu_stand_ins():
    """The attention ops' registration, on the CPU, with dense stand-ins registered as their CPU kernels in
    FlashAttention's place (the FlashAttention kernels themselves: the GPU tests above). doc_attention's output
    and its gradients of q, k and v are the stand-ins' bit for bit, eagerly and compiled (aot_eager: the ops'
    fakes and torch.compile's joint graph); the compiled graphs call doc_attention_fwd and doc_attention_bwd;
    the kernels get the window, max_len, scale and the deterministic-algorithms flag of the forward; and a call of
    either of the compiled graphs' ops runs no Python but its kernel's (and the op object's __call__): no
    autograd or wrapper layers, which cost host time on each of the step's Python launches."""
    T, H, D, window, max_len, scale = 96, 2, 16, 24, 64, 0.3
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 500, (T,), generator=g, dtype=torch.int32)
    ids[[0, 30, 31, 70]] = 511
    cu, docs = tg.doc_cu_seqlens(ids, 511), tg.doc_ids(ids, 511)
    qkv = [torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(3)]
    dy = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    calls = []

    def dense_fwd(q, k, v, cu_, window_, max_len_, scale_):
        calls.append(("fwd", int(window_), max_len_, scale_))
        out = tg.dense_attend(q, k, v, tg.DocSeq(cu_, docs, max_len_), int(window_), scale_).contiguous()
        return out, torch.zeros(H, T), torch.zeros(2, dtype=torch.int64)

    def dense_bwd(grad, q, k, v, out, lse, rng, cu_, window_, max_len_, scale_, deterministic):
        calls.append(("bwd", int(window_), max_len_, scale_, deterministic))
        return _dense_attention_grads(grad, q, k, v, docs, int(window_), scale_)

    def attention(q, k, v):
        return doc_attention(q, k, v, cu, torch.tensor(window), max_len, scale)[0]

    y_ref = tg.dense_attend(*qkv, tg.DocSeq(cu, docs, max_len), window, scale)
    g_ref = _dense_attention_grads(dy, *qkv, docs, window, scale)
    graphs = {}

    def record(name):
        def compiler(gm, example_inputs):
            graphs[name] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compiler

    def aot_eager(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=record("fw"), bw_compiler=record("bw"))

    lib = torch.library.Library("speedrun", "IMPL")
    lib.impl("doc_attention_fwd", dense_fwd, "CPU")
    lib.impl("doc_attention_bwd", dense_bwd, "CPU")
    torch._dynamo.reset()
    try:
        for compiled in (False, True):
            f = torch.compile(attention, backend=aot_eager, fullgraph=True) if compiled else attention
            calls.clear()
            leaves = [t.clone().requires_grad_() for t in qkv]
            y = f(*leaves)
            grads = torch.autograd.grad(y, leaves, dy)
            assert torch.equal(y, y_ref), f"compiled={compiled}"
            for name, a, b in zip("qkv", grads, g_ref):
                assert torch.equal(a, b), f"d{name}, compiled={compiled}"
            assert calls == [("fwd", window, max_len, scale), ("bwd", window, max_len, scale, False)], calls
        assert "speedrun.doc_attention_fwd.default" in graphs["fw"], graphs["fw"]
        assert "speedrun.doc_attention_bwd.default" in graphs["bw"], graphs["bw"]
        assert not any("speedrun.doc_attention.default" == n for n in graphs["fw"] | graphs["bw"])
        before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            calls.clear()
            leaves = [t.clone().requires_grad_() for t in qkv]
            torch.autograd.grad(attention(*leaves), leaves, dy)
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        assert calls[-1][-1] is True, calls
        # What the compiled step runs per call: the op object's __call__, then the kernel, nothing else.
        args = (*qkv, cu, torch.tensor(window), max_len, scale)
        with torch.no_grad():
            fwd_out = doc_attention_fwd(*args)
            names = _python_calls(dense_fwd, doc_attention_fwd, *args)
            assert names == ["__call__", "dense_fwd"], names
            names = _python_calls(dense_bwd, doc_attention_bwd, dy, *qkv, *fwd_out, cu, torch.tensor(window),
                                  max_len, scale, False)
            assert names == ["__call__", "dense_bwd"], names
    finally:
        lib._destroy()
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# --dynamic-tokens: one compiled training step for every micro-batch length


def _first_micro_batches(hp, files):
    """{T: (step, micro-batch)}: the loader's first micro-batch at the first step of each micro-batch length of hp's
    schedule (what the compile warmup runs)."""
    loader = tg.TrainLoader(hp, files, Dist(device=torch.device("cpu")), lambda s: tg.micro_tokens_at(hp, s))
    out = {}
    try:
        for start, _, _ in tg.stage_bounds(hp):
            T = tg.micro_tokens_at(hp, start)
            if T not in out:
                loader.rewind(start)
                out[T] = (start, loader.next()[0])
    finally:
        loader.close()
    return out


def test_pair_heads_interleaves_and_stays_a_view_under_dynamic_tokens():
    """pair_heads (T, H, D) -> (2T, H/2, D), the paired-head layers' sequence: row 2t + j holds token t's heads
    j H/2 .. (j + 1) H/2 - 1 (written again here, element by element), a view of its input in eager; and compiled
    by inductor (its CPU code) between a computed tensor and a matmul that needs it realised, with T a dynamic size
    (--dynamic-tokens), its code takes no index modulo a symbolic size and runs one kernel, the norm's
    (reshape(2T, H/2, D) indexes modulo 6T and copies the tensor in a second kernel)."""
    from torch._inductor.utils import run_and_get_code
    T, H, D = 5, 6, 4
    t = torch.randn(T, H, D)
    out = tg.pair_heads(t)
    assert out.shape == (2 * T, H // 2, D) and out.data_ptr() == t.data_ptr()
    for tok in range(T):
        for j in range(2):
            for i in range(H // 2):
                assert torch.equal(out[2 * tok + j, i], t[tok, j * (H // 2) + i]), (tok, j, i)

    w = torch.randn(D, D)

    def f(x):
        return torch.mm(tg.pair_heads(tg.rms_norm(x) * 2.0).flatten(0, 1), w)

    x = torch.randn(48, H, D)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):  # the code is generated, not read from a cache
        y, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
    torch._dynamo.reset()
    assert torch.allclose(y, f(x), rtol=1e-5, atol=1e-5)
    code = "\n".join(codes)
    assert "ks0" in code, "the row count is not a dynamic size in the compiled code"
    wraps = re.findall(r"%[^;\n]*ks\d", code)
    assert not wraps, f"an index modulo a dynamic size: {wraps[:2]}"
    assert code.count('extern "C"') == 1, "more than the norm's kernel: the paired heads were copied"


@pytest.mark.parametrize("dynamic,opt_in", [(True, False), (False, False), (True, True)],
                         ids=["dynamic_tokens", "static", "dynamic_tokens_opt_in"])
def test_dynamic_tokens_compile_one_training_graph_for_every_length(smoke_data, monkeypatch, dynamic, opt_in):
    """--dynamic-tokens: train_step, compiled as build_fns compiles it (fullgraph, dynamic=False), is one graph for
    every micro-batch length of the schedule (the two-layer smoke model's: 128 and 256 tokens, at stage starts whose
    documents are cut to 96 and 192 tokens); without the flag, one graph per length (what the flag changes). At each
    length the compiled step's loss and gradients of every parameter are the eager step's, bit for bit.

    What recompiles is dynamo's guards. With the flag the backend is aot_eager: torch.compile's tracing and AOT
    autograd's joint forward and backward graph over fake tensors, whose symbolic sizes can add guards too, then run
    op by op; the CPU checks that in seconds, inductor's code for symbolic sizes is the GPU's to check. Without it
    the eager backend (dynamo's graph run as it is) suffices: static sizes add no shape guard past dynamo's. The
    region is the CUDA one where the CPU can trace it: attention through the FlashAttention ops
    (speedrun::doc_attention, whose fakes and autograd take the symbolic length and documents' length bound), with
    dense CPU stand-ins as their kernels, which check the bound they are given; the head is the CPU's cross-entropy
    reference (the CUDA head's ops: test_dynamic_tokens_head_ops_take_a_symbolic_row_count; the fused MLP's
    Triton kernels cannot be traced on the CPU: tests/test_mlp.py checks its grid). opt_in: the four-layer smoke
    model with every change beyond record #74 to the forward (--one-stream --mudd --xsa, backout layer 1), whose
    ops must keep T symbolic too."""
    layout = dict(one_stream=True, mudd=True, xsa=True, backout_layer=1) if opt_in else TWO_LAYERS
    hp = tg.smoke_hyperparameters(param_dtype="float32", dynamic_tokens=dynamic, **layout,
                                  train_files=str(smoke_data / "smoke_train_*.bin"))
    batches = _first_micro_batches(hp, shard_files(hp.train_files))
    assert [(T, mb.max_len) for T, (_, mb) in batches.items()] == [(128, 96), (256, 192)]
    params = _perturbed_params(hp, seed=11)
    used = [k for k in params if opt_in or k not in OPT_IN_PARAMS]  # without --xsa / --mudd none reaches those
    bounds = []

    def docs_of(cu, n):  # document index per position, from the boundaries
        return torch.searchsorted(cu[1:-1].contiguous(), torch.arange(n, dtype=cu.dtype), right=True)

    def stand_in_fwd(q, k, v, cu, window, max_len, scale):
        assert int((cu[1:] - cu[:-1]).max()) <= max_len, "a document longer than the bound FlashAttention is given"
        bounds.append(max_len)
        docs = docs_of(cu, q.shape[0])
        out = dense_attend(q, k, v, tg.DocSeq(cu, docs, max_len), int(window), scale).contiguous()
        return out, torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2, dtype=torch.int64)

    def stand_in_bwd(grad, q, k, v, out, lse, rng, cu, window, max_len, scale, deterministic):
        return _dense_attention_grads(grad, q, k, v, docs_of(cu, q.shape[0]), int(window), scale)

    def attend(q, k, v, seq, window, scale):  # flash_attend's op call, in any dtype
        return doc_attention(q, k, v, seq.cu, window, seq.max_len, scale)[0]

    monkeypatch.setattr(tg, "dense_attend", attend)  # build_fns's attention on the CPU
    eager = tg.build_fns(hp, torch.device("cpu"), compile_model=False)
    compile_, backend = torch.compile, "aot_eager" if dynamic else "eager"
    monkeypatch.setattr(tg.torch, "compile", lambda f, **kw: compile_(f, backend=backend, **kw))
    compiled = tg.build_fns(hp, torch.device("cpu"), compile_model=True)
    assert ("--dynamic-tokens" in compiled.compile_path) == dynamic
    lib = torch.library.Library("speedrun", "IMPL")
    lib.impl("doc_attention_fwd", stand_in_fwd, "CPU")
    lib.impl("doc_attention_bwd", stand_in_bwd, "CPU")
    torch._dynamo.reset()
    graphs = unique_graphs()
    try:
        for T, (step, mb) in batches.items():
            w = tg.mtp_weights_at(hp, step)
            mtp = torch.tensor(w + (0.0,) * (3 - len(w)))  # the trainer's padding to the longest list
            out = []
            for fns in (eager, compiled):
                bounds.clear()
                loss = tg.forward(hp, params, fns, mb, tg.windows_at(hp, step), {}, train=True, mtp=mtp)
                out.append((loss.detach(), *torch.autograd.grad(loss, [params[k] for k in used])))
                # the paired-head layer's interleaved sequence has documents twice as long
                assert sorted(set(bounds)) == [mb.max_len, 2 * mb.max_len], (T, bounds)
            for name, a, b in zip(["loss", *used], *out, strict=True):
                assert torch.equal(a, b), f"T={T}: compiled {name} differs from eager: max |diff| " \
                                          f"{(a - b).abs().max():.3g}"
        frames = unique_graphs() - graphs
    finally:
        lib._destroy()
        torch._dynamo.reset()
    assert frames == (1 if dynamic else len(batches)), f"{frames} training graphs for {len(batches)} lengths"


def test_dynamic_tokens_head_ops_take_a_symbolic_row_count(device, monkeypatch):
    """The CUDA training head, head_loss with the FP8 head (bf16, the trainer's default on CUDA) and with its CE
    gradient written in the forward (--ce-grad-in-forward), compiled with a dynamic row count N (--dynamic-tokens),
    is one graph for two N, and at the second, where it runs the graph traced at the first, its loss and gradients
    are the eager head's bit for bit. The FP8 gradient's scale FP8_GRAD_S / (N * SLOTS) reaches the ops as
    FP8_GRAD_S and the integer N * SLOTS: a float computed from N in the graph would be a constant of it, guarded (a
    recompile per N); the two make the trainer's scale (checked eagerly). aot_eager: the ops' fakes and the joint
    graph over fake tensors, then the ops themselves; on the CPU torch._scaled_mm's CPU kernel and our kernels in
    Triton's interpreter (one interpreted program per row: 8 and 16 rows; CUDA's _scaled_mm takes multiples of 16)."""
    C, V = 32, 64
    first, second = (16, 32) if device == "cuda" else (8, 16)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(C, V, generator=g) * 0.05).to(device, torch.bfloat16).requires_grad_()
    wk = torch.tensor([1.0, 0.5, 0.25], device=device)
    head8 = tg.fp8_head_weights(w, tg.FP8_W_S)

    def inputs(N):
        x = torch.randn(N, C, generator=g).to(device, torch.bfloat16).requires_grad_()
        t = torch.randint(0, V, (N,), generator=g).to(device)
        tg.mark_tokens_dynamic(x, t)
        return x, t

    scales = []
    with monkeypatch.context() as m:
        for name in ("fp8_head_ce", "fp8_head_ce_grad_in_fwd"):  # grad_s is their tenth argument, grad_s_div last
            m.setattr(tg, name, lambda *a, op=getattr(tg, name): scales.append(a[9] / a[-1]) or op(*a))
        x, t = inputs(first)
        for grad_in_fwd in (False, True):
            tg.head_loss(x, w, t, wk, 23.0, tg.softcapped_cross_entropy, True, grad_in_fwd, head8)
    assert scales == [tg.FP8_GRAD_S / (first * tg.SLOTS)] * 2, scales
    for grad_in_fwd in (False, True):
        def head(x, t):
            return tg.head_loss(x, w, t, wk, 23.0, tg.softcapped_cross_entropy, True, grad_in_fwd, head8)

        torch._dynamo.reset()
        graphs = unique_graphs()
        compiled = torch.compile(head, backend="aot_eager", fullgraph=True, dynamic=False)
        try:
            compiled(*inputs(first))  # traced here, forward and backward
            x, t = inputs(second)
            out = []
            for f in (head, compiled):
                loss = f(x, t)
                out.append((loss.detach(), *torch.autograd.grad(loss, (x, w))))
            for name, a, b in zip(("loss", "dx", "dW"), *out):
                assert torch.equal(a, b), f"grad_in_fwd={grad_in_fwd}: compiled {name} differs from eager (N={second})"
            frames = unique_graphs() - graphs
        finally:
            torch._dynamo.reset()
        assert frames == 1, f"{frames} graphs of the FP8 head (grad_in_fwd={grad_in_fwd}) for two row counts"


# ----------------------------------------------------------------------------------------------------
# Data loader, schedule, errors


def test_micro_batch_pack_moves_the_eager_tensors_in_one_copy(smoke_data):
    """MicroBatch.pack (the loader's): prep, bigram and bigram_prep become views of one int32 buffer, each at a
    multiple of 128 bytes, with their values; to() moves a packed micro-batch with 4 copies (ids, targets,
    cu_seqlens, the buffer) instead of 10, and rebuilds the views at the same offsets of the moved buffer; ids,
    targets and cu_seqlens keep storages of their own (the compiled region's inputs)."""
    V, rows, T = 500, 251, 300  # odd lengths (V + 1, rows + 1 = 501 and 252): the alignment must pad them
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V - 1, (T,), generator=g, dtype=torch.int32)
    ids[[0, 90, 91]] = V - 1
    big = tg.bigram_hash(ids, rows, V - 1)
    mb = tg.MicroBatch(ids, torch.randint(0, V, (T,), generator=g), tg.prepare_ids(ids, V),
                       tg.doc_cu_seqlens(ids, V - 1), big, tg.prepare_ids(big, rows), max_len=128)

    def eager_of(m):
        return [*m.prep[:3], m.bigram, *m.bigram_prep[:3]]

    eager = eager_of(mb)
    packed = mb.pack()
    for a, b in zip(eager_of(packed), eager, strict=True):
        assert torch.equal(a, b)
        assert a.untyped_storage().data_ptr() == packed.eager.untyped_storage().data_ptr()
        assert a.storage_offset() % 32 == 0, a.storage_offset()
    for name in tg.MicroBatch.OWN:
        assert torch.equal(getattr(packed, name), getattr(mb, name))
        assert getattr(packed, name).untyped_storage().data_ptr() != packed.eager.untyped_storage().data_ptr()
    assert packed.max_len == 128 and packed.prep.num_embeddings == V and packed.bigram_prep.n == T

    def copies(m):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            moved = m.to(torch.device("meta"))
        return sum(e.name == "aten::_to_copy" for e in prof.events()), moved

    n_packed, moved = copies(packed)
    n_plain, _ = copies(mb)
    assert (n_packed, n_plain) == (4, 10)
    assert moved.eager.device.type == "meta"
    for a, b in zip(eager_of(moved), eager_of(packed), strict=True):
        assert a.device.type == "meta" and a.shape == b.shape and a.storage_offset() == b.storage_offset()
    back = packed.to(torch.device("cpu"))
    for a, b in zip(eager_of(back), eager, strict=True):
        assert torch.equal(a, b)
    hp = tg.smoke_hyperparameters()
    ld = tg.TrainLoader(hp, shard_files(smoke_data / "smoke_train_*.bin"), Dist(), lambda s: 256)
    for m in ld.next():
        assert all(t.untyped_storage().data_ptr() == m.eager.untyped_storage().data_ptr() for t in eager_of(m))
    ld.close()


def test_loader_rank_split_matches_single_rank(smoke_data):
    hp = tg.smoke_hyperparameters()
    files = shard_files(smoke_data / "smoke_train_*.bin")
    T = 256
    out = {}
    for world in (1, 2):
        for rank in range(world):
            ld = tg.TrainLoader(hp, files, Dist(rank=rank, world=world), lambda s: T)
            out[(world, rank)] = [ld.next() for _ in range(2)]
            ld.close()
    for step in range(2):
        single = out[(1, 0)][step]
        assert len(single) == tg.SLOTS
        for r in range(2):
            part = out[(2, r)][step]
            assert len(part) == tg.SLOTS // 2
            for a, b in zip(part, single[r::2]):
                assert torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
        for mb in single:
            assert mb.ids.shape == (T,) and mb.ids.dtype == torch.int32
            assert int(mb.ids[0]) == hp.bos_id, "every micro-batch starts at a document"
            assert torch.equal(mb.ids[1:].long(), mb.targets[:-1])
            starts = torch.nonzero(mb.ids == hp.bos_id)[:, 0].tolist() + [T]
            assert max(b - a for a, b in zip(starts, starts[1:])) <= tg.stage_at(hp, step)[1].max_doc_len == mb.max_len
    # consecutive steps continue the stream (no repeated batch)
    assert not torch.equal(out[(1, 0)][0][0].ids, out[(1, 0)][1][0].ids)


def test_schedule_matches_the_public_record():
    """Record #74's TrainingSchedule: 1450 scheduled steps + 40, stages ending at round(1450 k / 3), cooldown over
    the last 60% (from int(1450 * 0.4) = 580), documents cut to 896 tokens in stage 0 and 2048 after, the
    embedding untied after the first odd (Adam) step of stage 2 (its split_step 967), the final validation's long
    window 20 blocks with the last stage's YaRN, validation as 40 chunks of 262,144 tokens. (--steps 1450
    --extension-steps 40; the default is record #82's: test_default_schedule_is_record_82s.)"""
    hp = tg.Hyperparameters(scheduled_steps=1450, extension_steps=40)
    assert hp.total_steps == 1490
    bounds = tg.stage_bounds(hp)
    assert [(a, b) for a, b, _ in bounds] == [(0, 483), (483, 967), (967, 1450), (1450, 1490)]
    assert [tg.micro_tokens_at(hp, s) for s in (0, 483, 967, 1489)] == [16384, 32768, 49152, 49152]
    assert [tg.stage_at(hp, s)[1].max_doc_len for s in (0, 482, 483, 1489)] == [896, 896, 2048, 2048]
    assert tg.lr_factor(hp, 580) == 1.52 and tg.lr_factor(hp, 581) < 1.52  # the cooldown starts at 580
    assert tg.lr_factor(hp, 0) == 1.0 and tg.lr_factor(hp, 500) == 1.52
    assert tg.lr_factor(hp, 1015) == pytest.approx(1.73 * (1 - 435 / 870) + 0.15 * 435 / 870)
    assert tg.lr_factor(hp, 1450) == pytest.approx(hp.cooldown_floor)
    assert tg.muon_momentum(hp, 0) == hp.muon_momentum_min
    assert tg.muon_momentum(hp, 300) == hp.muon_momentum_max
    assert tg.muon_momentum(hp, 1490) == pytest.approx(hp.muon_momentum_min)
    assert tg.untie_step(hp) == 968
    assert tg.val_windows(hp, 500) == ((3, 7), None)
    assert tg.val_windows(hp, 1490) == ((6, 20), 13)
    assert all(tg.micro_tokens_at(hp, s) % tg.BLOCK == 0 for s in range(hp.total_steps))
    assert (hp.val_micro_tokens, hp.val_tokens // hp.val_micro_tokens) == (262_144, 40)


def test_default_schedule_is_record_82s():
    """The default schedule is public record #82's: 1375 scheduled steps + 10 (records #80, #81, #82 cut 10, 65 and
    30 steps from record #74's 1450 + 40 in all), with record #74's stage table: stages ending at round(1375 k / 3),
    the cooldown from int(1375 * 0.4) = 550, the untie after stage 2's first slow Adam step (917, odd; the last
    step, 1384, is one too: test_slow_adam_schedule)."""
    hp = tg.Hyperparameters()
    assert (hp.scheduled_steps, hp.extension_steps, hp.total_steps) == (1375, 10, 1385)
    assert [(a, b) for a, b, _ in tg.stage_bounds(hp)] == [(0, 458), (458, 917), (917, 1375), (1375, 1385)]
    assert [tg.micro_tokens_at(hp, s) for s in (0, 458, 917, 1384)] == [16384, 32768, 49152, 49152]
    assert [tg.stage_at(hp, s)[1].max_doc_len for s in (0, 457, 458, 1384)] == [896, 896, 2048, 2048]
    assert tg.lr_factor(hp, 550) == 1.52 and tg.lr_factor(hp, 551) < 1.52  # the cooldown starts at 550
    assert tg.lr_factor(hp, 1375) == pytest.approx(hp.cooldown_floor)
    assert tg.muon_momentum(hp, 1335) == hp.muon_momentum_max  # back to min over the last 50 steps
    assert tg.muon_momentum(hp, 1385) == pytest.approx(hp.muon_momentum_min)
    assert tg.untie_step(hp) == 918
    assert tg.val_windows(hp, 1384) == ((6, 13), None) and tg.val_windows(hp, 1385) == ((6, 20), 13)


@pytest.mark.parametrize("world", [3, 5, 6, 16])
def test_unsupported_world_size_is_rejected(world):
    with pytest.raises(ValueError, match=f"world size {world} is not supported.*1, 2, 4 or 8"):
        tg.check_world_size(world)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_supported_world_sizes(world):
    assert tg.check_world_size(world) == 8 // world


def test_missing_data_names_the_download_command(tmp_path, capsys):
    argv = ["--smoke", "--train-files", str(tmp_path / "fineweb10B" / "fineweb_train_*.bin"),
            "--val-files", str(tmp_path / "fineweb10B" / "fineweb_val_*.bin"), "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        tg.main(argv)
    assert info.value.code == 2
    assert re.search(r"python data/cached_fineweb10B\.py 9.*data/prepare_text\.py", capsys.readouterr().err)


def test_command_line_missing_data_is_one_message_not_a_traceback(tmp_path):
    """Run as a script, a data problem prints one error line and exits 2 (no traceback wall). The one error test
    through a real process (python train_gpt.py from a fresh interpreter); the others run the script's main block
    in this process (tests/conftest.py's script_main), which prints and exits the same way."""
    env = os.environ  # TRITON_INTERPRET=1 on the CPU (conftest.py), the worker's GPU on a GPU machine
    res = subprocess.run([sys.executable, str(Path(tg.__file__)), "--smoke", "--train-files",
                          str(tmp_path / "nothing_*.bin"), "--val-files", str(tmp_path / "nothing_val_*.bin"),
                          "--log-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("train_gpt.py: error: no shard files match") and "prepare_text.py" in res.stderr


def _repository_text(split):
    """The smoke corpus's tokens of ``split`` as data/smoke_corpus.py specifies them: every non-empty *.py and *.md
    file of the repository outside hidden folders and site-packages, sorted by path, each as 256 followed by its
    bytes; every 10th file (the 10th, 20th, ...) is validation, the rest training."""
    files = sorted(p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
                   if p.suffix in (".py", ".md") and p.is_file() and p.stat().st_size > 0
                   and not any(part.startswith(".") or part == "site-packages" for part in p.relative_to(REPO).parts))
    picked = [f for i, f in enumerate(files) if (i % 10 == 9) == (split == "val")]
    return np.concatenate([np.concatenate([[256], np.frombuffer((REPO / f).read_bytes(), np.uint8)])
                           for f in picked]).astype(np.uint16)


def test_first_run_without_shards_trains_on_the_repositorys_text(tmp_path, monkeypatch, capsys):
    """README's first run, `python train_gpt.py --smoke` where the default shards are missing (a fresh clone, no
    network): one line says so, the byte-level corpus of the repository's text goes to data/smoke/ (relative to
    the working directory, like the default globs), --vocab-from-data takes vocabulary 384 and BOS 256 from it, and
    the validation loss falls from about ln(384). A second run reads the corpus it finds there (smoke_corpus).
    Three steps, not the smoke run's ten (--steps 3 --extension-steps 0 --untie-stage 0: both stages, the untie
    after step 0): the loss falls by about 2.0 in them (the ten-step schedule is test_smoke_loss_falls_and_log_parses's).
    """
    monkeypatch.chdir(tmp_path)
    log_path, _ = tg.main(["--smoke", "--steps", "3", "--extension-steps", "0", "--untie-stage", "0"])
    said = ("no shards match data/fineweb10B/fineweb_train_*.bin: --smoke trains on this repository's *.py and *.md "
            "files as bytes (vocabulary 384, BOS 256), {} data/smoke/\n")
    assert capsys.readouterr().out.startswith(said.format("written to"))
    for split, index in (("train", 1), ("val", 0)):
        np.testing.assert_array_equal(load_shard(tmp_path / "data" / "smoke" / f"smoke_{split}_{index:06d}.bin"),
                                      _repository_text(split))
    text, _, vals = _parse(tmp_path / log_path)
    hp_logged = json.loads(re.search(r"^hyperparameters: (.*)$", text, re.M)[1])
    assert (hp_logged["vocab_size"], hp_logged["bos_id"]) == (384, 256)
    assert hp_logged["train_files"] == "data/smoke/smoke_train_*.bin"
    first, last = float(vals[0]), float(vals[3])
    assert abs(first - math.log(384)) < 0.5, first
    assert last < first - 1.0, (first, last)
    hp = cli.smoke_corpus(tg.smoke_hyperparameters(), _flags(["--smoke"])[0], Dist())
    assert capsys.readouterr().out == said.format("read from")
    assert (hp.train_files, hp.val_files) == ("data/smoke/smoke_train_*.bin", "data/smoke/smoke_val_*.bin")


def test_help_imports_no_compiler(tmp_path):
    """`train_gpt.py --help` imports torch and the kernels (train_gpt.py's imports), never torch.compile's dynamo,
    inductor or sympy, which only a compiled run needs (they take about as long to import as torch itself)."""
    res = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train_gpt.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, env=os.environ, timeout=300)
    assert res.returncode == 0 and "--keep-last" in res.stdout, res.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and "kernels.mlp" in imported
    assert not {"torch._dynamo", "torch._inductor", "sympy"} & imported


def _write_ids(path, ids):
    write_shard(path, np.asarray(ids, dtype=np.uint16))
    return path


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_id_beyond_the_vocabulary_is_one_line_exit_2(tmp_path, split, script_main, capsys):
    """A shard with an id >= vocab_size (here the default 50304) is refused before any model is built: one
    line naming the file and the first bad position, exit code 2 (not an IndexError or a device assert)."""
    good = np.tile(np.array([50256, 10, 20, 30], dtype=np.uint16), 1000)
    bad = good.copy()
    bad[1234], bad[2000] = 50304, 65535
    _write_ids(tmp_path / "t_train_000001.bin", good)
    _write_ids(tmp_path / "t_val_000000.bin", good)
    target = _write_ids(tmp_path / f"t_{split}_{'000002' if split == 'train' else '000001'}.bin", bad)
    argv = ["--smoke", "--no-vocab-from-data", "--vocab-size", "50304", "--bos-id", "50256",
            "--train-files", str(tmp_path / "t_train_*.bin"), "--val-files", str(tmp_path / "t_val_*.bin"),
            "--log-dir", str(tmp_path / "logs")]
    message = (f"{target}: token id 50304 at position 1234 is outside the model's vocabulary "
               f"(vocab_size 50304)")
    if split == "val":  # in process: the error is raised before anything is built
        with pytest.raises(SystemExit) as info:
            tg.main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err.startswith(f"train_gpt.py: error: {message}")
        assert not (tmp_path / "logs").exists()
        return
    # train: as the script's main block (in this process: script_main) prints it, one line and exit code 2
    assert script_main(tg, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"train_gpt.py: error: {message}"), err


@pytest.mark.parametrize("top, vocab", [(511, 512), (512, 640), (50256, 50304)])
def test_smoke_takes_vocabulary_and_bos_from_the_data(tmp_path, top, vocab):
    f = _write_ids(tmp_path / "s.bin", [top, 1, 2, top, 3])
    hp = cli.fit_to_data(tg.smoke_hyperparameters(), [f], [f])
    assert (hp.vocab_size, hp.bos_id) == (vocab, top)
    fixed = cli.fit_to_data(tg.Hyperparameters(), [f], [f])  # the speedrun config keeps its own
    assert (fixed.vocab_size, fixed.bos_id) == (50304, 50256)


def _gpt2_shards(tmp_path):
    """Train and val shards made by data/prepare_text.py with GPT-2's BPE: sentences with a fixed word order."""
    from data import prepare_text
    rng = np.random.default_rng(0)
    words = "the cat dog sat ran on under a mat box red blue big small and then".split()
    for part, n_docs in (("train", 60), ("val", 12)):
        src = tmp_path / f"src_{part}"
        src.mkdir()
        for i in range(n_docs):
            start = rng.integers(0, len(words), size=60)
            text = " ".join(" ".join(words[(s + j) % len(words)] for j in range(6)) + "." for s in start)
            (src / f"doc{i:03d}.txt").write_text(text)
        # --val-fraction 0: every document in NAME_train_*; the val run's shard serves as the validation file
        assert prepare_text.main([str(src), "--out", str(tmp_path / "shards"), "--name", part,
                                  "--val-fraction", "0"]) == 0
    return str(tmp_path / "shards" / "train_train_*.bin"), str(tmp_path / "shards" / "val_train_*.bin")


needs_gpt2 = pytest.mark.skipif(_gpt2_cache_dir() is None, reason="tiktoken's gpt2 files are not available "
                                "offline (set TIKTOKEN_CACHE_DIR to run this)")


@needs_gpt2
def test_smoke_fits_gpt2_shards(tmp_path, monkeypatch, device):
    """The smoke config on GPT-2 shards: vocabulary 50304 and BOS 50256 from the data, and the model runs on
    them (the 512-token smoke model used to fail in F.embedding), starting near ln(50304)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_gpt2_cache_dir()))
    train, val = _gpt2_shards(tmp_path)
    files, val_files = shard_files(train), shard_files(val)
    hp = cli.fit_to_data(tg.smoke_hyperparameters(train_files=train, val_files=val), files, val_files)
    assert (hp.vocab_size, hp.bos_id) == (50304, 50256)
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), files, val_files)
    mb = tr.loader.next()[0]
    tr.loader.close()
    assert int(mb.ids.max()) > 511 and int(mb.ids[0]) == 50256
    with torch.no_grad():
        loss = tg.forward(hp, tr.params, tr.fns, mb, tg.windows_at(hp, 0), {}, train=False).item()
    assert abs(loss - math.log(50304)) < 0.05, loss


@needs_gpt2
def test_smoke_runs_on_gpt2_shards(tmp_path, monkeypatch):
    """--smoke end to end on GPT-2 shards made by data/prepare_text.py: the loss falls from ln(50304). On the CPU
    the trainer runs the kernels' PyTorch references (StepKernels, cpu_embedding, the CE reference), so this is
    the first run a new user makes and takes well under a minute. Two steps, not ten (--steps 2 --extension-steps 0
    --untie-stage 0: one per stage, the untie after step 0): at vocabulary 50304 a CPU step costs seconds (the head,
    the cross-entropy and Adam over the 50304-row tables), and the loss falls by about 2.3 in them; validations of
    8 micro-batches (--val-tokens 2048, the fewest the check of the shard allows), not 16."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_gpt2_cache_dir()))
    train, val = _gpt2_shards(tmp_path)
    log_path, _ = tg.main(["--smoke", "--train-files", train, "--val-files", val, "--log-dir", str(tmp_path / "logs"),
                           "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2", "--extension-steps", "0",
                           "--untie-stage", "0", "--val-tokens", "2048"])
    text, steps, vals = _parse(log_path)
    hp_logged = json.loads(re.search(r"^hyperparameters: (.*)$", text, re.M)[1])
    assert (hp_logged["vocab_size"], hp_logged["bos_id"]) == (50304, 50256)
    first, last = float(vals[0]), float(vals[max(vals)])
    assert abs(first - math.log(50304)) < 0.1, first
    assert last < first - 1.0, (first, last)


@on_smoke_run
def test_resume_with_another_world_size_is_rejected(smoke_run):
    _, _, ckpt_dir = smoke_run
    with pytest.raises(checkpoints.CheckpointError, match="written by 1 ranks, this run has 2"):
        checkpoints.check_resume(tg.smoke_hyperparameters(), ckpt_dir / "step_000005", Dist(rank=0, world=2))


@on_smoke_run
def test_sample_continues_the_learned_rule(smoke_run, monkeypatch, capsys):
    """--sample on the smoke checkpoint, with a stand-in tokenizer (GPT-2's BPE files need the network and
    the smoke vocabulary has 512 ids). Greedy decoding: each new token is the argmax of the model's logits at
    the end of the sequence so far, which starts with BOS then the prompt (checked token by token here), and
    the text printed is the prompt and the continuation. Learning: 10 smoke steps leave the model far from
    sure (top-1 probabilities of a few percent with every feature on), so the rule next = prev + 7..9 is checked
    on its distribution after the prompt: at least 4x the uniform mass on the rule's three tokens."""
    import types

    class Enc:
        def encode_ordinary(self, s):
            return [int(t) for t in s.split()]

        def decode(self, ids):
            return " ".join(map(str, ids))

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: Enc()))
    _, _, ckpt_dir = smoke_run
    [text] = tg.main(["--sample", str(ckpt_dir / "step_000010"), "--prompt", "100 108 116", "--max-new-tokens", "5"])
    ids = [int(t) for t in text.split()]
    assert ids[:3] == [100, 108, 116] and len(ids) == 8
    assert text in capsys.readouterr().out
    hp, params, fns = tg.load_model(ckpt_dir / "step_000010", Dist())
    with torch.no_grad():
        for n in range(3, 8):
            seq = torch.tensor([hp.bos_id] + ids[:n], dtype=torch.int32)
            logits = tg.sequence_logits(hp, params, fns, seq, {})
            assert logits.shape == (n + 1, tg.real_vocab(hp))
            assert int(logits[-1].argmax()) == ids[n], f"token {n}: not the greedy choice"
            if n == 3:
                p = torch.softmax(logits[-1].double(), 0)
                rule = float(p[[(116 + k) % 511 for k in (7, 8, 9)]].sum())
                assert rule >= 4 * 3 / 511, f"rule mass {rule:.4f} after the prompt: the rule was not learned"


# ----------------------------------------------------------------------------------------------------
# Command line and logged sources


def test_help_lists_every_hyperparameter_with_its_comment(script_main, capsys, monkeypatch):
    """``train_gpt.py --help`` (the script's main block, in this process: tests/conftest.py's script_main)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert script_main(tg, ["--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(tg.Hyperparameters):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "stages":
            assert flag not in flat
            continue
        assert flag in flat, f"--help lacks {flag}"
    comments = field_comments(tg.Hyperparameters)
    assert set(comments) == {f.name for f in dataclasses.fields(tg.Hyperparameters)}, "a field has no comment"
    assert comments["muon_beta2"] == "NorMuon second-moment decay" and comments["muon_beta2"] in flat


def test_generated_flags_set_their_fields():
    _, hp = _flags(["--muon-warmup-steps", "7", "--adam-lr", "0.5", "--no-compile", "--log-train-loss",
                          "--ve-tables", "1,-1,0", "--no-attn-layers", "", "--param-dtype", "float32"])
    assert (hp.muon_warmup_steps, hp.adam_lr, hp.compile, hp.log_train_loss) == (7, 0.5, False, True)
    assert (hp.ve_tables, hp.no_attn_layers, hp.param_dtype) == ((1, -1, 0), (), "float32")
    assert type(hp.muon_warmup_steps) is int and type(hp.adam_lr) is float
    untouched = {f.name for f in dataclasses.fields(hp)} - {"muon_warmup_steps", "adam_lr", "compile",
                                                            "log_train_loss", "ve_tables", "no_attn_layers",
                                                            "param_dtype"}
    default = tg.Hyperparameters()
    assert all(getattr(hp, k) == getattr(default, k) for k in untouched)
    # the short names of the README and the records
    _, hp = _flags(["--smoke", "--steps", "12", "--train-loss", "--seed", "3", "--extension-steps", "1",
                    "--val-every", "2"])
    smoke = tg.smoke_hyperparameters()
    assert (hp.scheduled_steps, hp.log_train_loss, hp.seed, hp.extension_steps, hp.val_every) == (12, True, 3, 1, 2)
    assert (hp.num_layers, hp.stages) == (smoke.num_layers, smoke.stages)


@pytest.mark.parametrize("argv, start", [
    (["--steps", "x"], "argument --scheduled-steps/--steps"), (["--adam-lr", "fast"], "argument --adam-lr"),
    (["--ve-tables", "0,a"], "argument --ve-tables"), (["--seed", "1.5"], "argument --seed"),
    (["--adam-every", "0"], "--adam-every: must be >= 1"), (["--steps", "0"], "--steps: must be >= 1"),
    (["--val-every", "-1"], "--val-every: must be >= 0")])
def test_bad_flag_value_is_one_line_exit_2(argv, start, capsys):
    """A value argparse cannot convert, or one check_settings refuses: one line naming the flag, exit code 2
    (in process: main() raises SystemExit(2) after printing it)."""
    with pytest.raises(SystemExit) as info:
        tg.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"train_gpt.py: error: {start}"), err
    assert len(err.splitlines()) <= 3, "a bad value should not print the whole flag list"


@on_smoke_run
def test_smoke_log_holds_the_logged_sources(smoke_run):
    """The smoke log's copy of the code is run_log.logged_sources() at the end of the run (tests/test_run_log.py):
    the trainer, the modules beside it, kernels/ and data/, sorted, never a benchmark case."""
    _, log_path, _ = smoke_run
    text = log_path.read_text()
    logged = re.findall(r"^# ===== file: (\S+) =====$", text, re.M)
    assert logged == sorted(logged) and set(logged) <= set(run_log.logged_sources())
    assert {"train_gpt.py", "kernels/_checks.py", "kernels/hardware.py", "data/shards.py", "kernels/adam.py",
            "kernels/embedding.py", "kernels/momentum.py", "kernels/polar_express.py", "kernels/transpose.py",
            "checkpoints.py", "cli.py", "compilation.py", "evaluation.py", "profiling.py", "run_log.py"} <= set(logged)
    assert "def bench_cases" not in text


# ----------------------------------------------------------------------------------------------------
# --compile-cache without compilation (compilation.py: tests/test_compilation.py), zero-padded MTP weights


def test_compile_cache_without_compilation_is_reported_unused(smoke_data, tmp_path):
    log_path, _ = tg.main(_smoke_argv(smoke_data, tmp_path, "cc", "--steps", "2", "--extension-steps", "0",
                                      "--compile-cache", str(tmp_path / "cc"), "--no-compile", *TWO_LAYER_FLAGS))
    text = Path(log_path).read_text()
    assert f"compile_cache: --compile-cache {tmp_path / 'cc'} not used (nothing is compiled)" in text
    assert not (tmp_path / "cc").exists()


def test_zero_padded_multi_token_weights_change_nothing(device, smoke_data):
    """The trainer pads every step's multi-token weights to the stage table's longest list with zeros (one input
    shape for the compiled region in every stage): loss and gradient equal the unpadded ones."""
    hp = tg.smoke_hyperparameters(param_dtype="float32")
    params = _perturbed_params(hp, seed=4, device=device)
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    ids, targets = _batch(hp, 256, seed=6, n_docs=3)
    mb = tg.MicroBatch(ids.to(device), targets.to(device), tg.prepare_ids(ids, hp.vocab_size).to(device))
    out = []
    for w in ([1.0, 0.5], [1.0, 0.5, 0.0]):
        loss = tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=torch.tensor(w, device=device))
        out.append((loss.detach(), torch.autograd.grad(loss, params["lm_head"])[0]))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    hp = tg.smoke_hyperparameters(train_files=str(smoke_data / "smoke_train_*.bin"),
                                  val_files=str(smoke_data / "smoke_val_*.bin"))
    tr = tg.Trainer(hp, Dist(device=torch.device(device)), shard_files(hp.train_files),
                    shard_files(hp.val_files))
    for s in range(hp.total_steps):
        w = tg.mtp_weights_at(hp, s)
        assert tr.mtp[s].tolist() == pytest.approx(list(w) + [0.0] * (3 - len(w)), abs=1e-7), s
    assert len(tg.mtp_weights_at(hp, hp.total_steps - 1)) == 1  # the last stage really is shorter


# ----------------------------------------------------------------------------------------------------
# --ce-grad-in-forward: the head's loss with its gradient written by the CE forward kernel


def test_ce_grad_in_forward_flag_and_head_path(device):
    """Off by default (opt-in); --ce-grad-in-forward turns it on; the log's lm_head_matmul line names the CE path on
    CUDA (the CPU runs the CE reference, whatever the flag)."""
    assert tg.Hyperparameters().ce_grad_in_forward is False
    assert _flags(["--smoke", "--ce-grad-in-forward"])[1].ce_grad_in_forward is True
    on, off = (tg.build_fns(tg.smoke_hyperparameters(ce_grad_in_forward=f), torch.device(device), compile_model=False)
               for f in (True, False))
    if device == "cuda":
        assert on.head_path.endswith("; CE gradient written by the forward kernel (--ce-grad-in-forward)")
        assert off.head_path.endswith("; CE forward and backward kernels (--no-ce-grad-in-forward)")
    else:
        assert on.head_path == off.head_path and "CE" not in on.head_path


# ----------------------------------------------------------------------------------------------------
# --mlp-act-only: the fused MLP saves act alone and takes relu(pre) as sqrt(act) (record #87's idea)


def _check_added_setting_resumes_off(name):
    """A setting added after checkpoints were written (checkpoints.ADDED_SETTINGS): on, --resume refuses a
    checkpoint that has it off, naming the flag; a checkpoint from before the setting existed resumes as off and
    is refused with it on, and --sample / --hellaswag (saved_hyperparameters) read it as off, whatever the
    dataclass's default; it is not among the settings a resumed run may change."""
    hp = dataclasses.asdict(tg.smoke_hyperparameters())
    on = dict(hp, **{name: True})
    refused = f"--{name.replace('_', '-')} is False in the checkpoint, True in this run"
    with pytest.raises(checkpoints.CheckpointError, match=refused):
        checkpoints.check_same_settings("ckpt", hp, on, list(on))
    before = {k: v for k, v in hp.items() if k != name}
    checkpoints.check_same_settings("ckpt", before, hp, list(hp))
    with pytest.raises(checkpoints.CheckpointError, match=refused):
        checkpoints.check_same_settings("ckpt", before, on, list(on))
    saved = checkpoints.saved_hyperparameters("ckpt", {"hyperparameters": before}, tg.Hyperparameters, tg.Stage)
    assert getattr(saved, name) is checkpoints.ADDED_SETTINGS[name] is False
    assert name not in checkpoints.RESUME_MAY_DIFFER


def test_mlp_act_only_flag_path_refusal_and_resume(device, monkeypatch, capsys):
    """Off by default (opt-in); --mlp-act-only turns it on. It is a mode of the fused MLP kernel: with
    --no-fused-mlp it is refused in one line (exit code 2); where the fused kernel does not run (the CPU, fp32
    matrices) the composite runs, as it does for --fused-mlp, and the log's mlp line says the flag is unused; on
    CUDA with bf16 it names the act-only path and the layers get the act-only sublayer. It changes bits (dpre's
    ReLU' factor), so --resume refuses it against a checkpoint that lacks it, naming it; a checkpoint from before
    the flag (no such setting) resumes as --no-mlp-act-only (checkpoints.ADDED_SETTINGS), and --resume's help does
    not list it among the flags that may differ."""
    assert tg.Hyperparameters().mlp_act_only is False
    assert _flags(["--smoke", "--mlp-act-only"])[1].mlp_act_only is True
    with pytest.raises(SystemExit) as info:
        tg.main(["--smoke", "--mlp-act-only", "--no-fused-mlp"])
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert err == ["train_gpt.py: error: --mlp-act-only: a mode of the fused MLP kernel, which --no-fused-mlp turns "
                   "off; leave out one of them"], err
    chosen = []
    make_layers = tg.make_layers
    monkeypatch.setattr(tg, "make_layers", lambda hp, attend, mlp, **kw: chosen.append(mlp) or make_layers(hp, attend, mlp, **kw))
    for dtype in ("bfloat16", "float32"):
        default, act_only = (tg.build_fns(tg.smoke_hyperparameters(param_dtype=dtype, mlp_act_only=a),
                                          torch.device(device), compile_model=False) for a in (False, True))
        if device == "cuda" and dtype == "bfloat16":
            assert act_only.mlp_path == default.mlp_path + ("; act saved alone, relu(pre) = sqrt(act) in the backward "
                                                            "(--mlp-act-only)")
            assert chosen[-2] is tg.fused_mlp_sublayer and chosen[-1] not in (tg.fused_mlp_sublayer, tg.mlp_sublayer)
        else:
            assert act_only.mlp_path == default.mlp_path + "; --mlp-act-only unused (a mode of the fused kernel)"
            assert chosen[-2:] == [tg.mlp_sublayer, tg.mlp_sublayer]
    _check_added_setting_resumes_off("mlp_act_only")
    with pytest.raises(SystemExit):
        _flags(["--help"])
    resume_help = " ".join(capsys.readouterr().out.split()).split("--resume RESUME", 1)[1].split("--deterministic")[0]
    assert "--cpp-wrapper" in resume_help and "--mlp-act-only" not in resume_help, resume_help


def test_one_stream_flag_and_resume():
    """--one-stream (record #77's forward: tests/test_model.py) is on by default and --no-one-stream turns it off
    (the smoke config has it off, record #74's two lanes); it changes the model, so --resume refuses it against a
    checkpoint without it, naming it, and a checkpoint from before the flag resumes as --no-one-stream
    (checkpoints.ADDED_SETTINGS)."""
    assert tg.Hyperparameters().one_stream is True and tg.smoke_hyperparameters().one_stream is False
    assert _flags(["--no-one-stream"])[1].one_stream is False
    assert _flags(["--smoke", "--one-stream"])[1].one_stream is True
    _check_added_setting_resumes_off("one_stream")


def test_mudd_flag_and_resume():
    """--mudd (record #81 on one stream: tests/test_model.py) is on by default and --no-mudd turns it off (the smoke
    config has it off); it changes the model, so --resume refuses it against a checkpoint without it, naming it,
    and a checkpoint from before the flag resumes as --no-mudd (checkpoints.ADDED_SETTINGS); its three parameters
    are among ADDED_PARAMS, shaped as init_params makes them."""
    assert tg.Hyperparameters().mudd is True and tg.smoke_hyperparameters().mudd is False
    assert _flags(["--no-mudd"])[1].mudd is False
    assert _flags(["--smoke", "--one-stream", "--mudd"])[1].mudd is True
    _check_added_setting_resumes_off("mudd")
    hp = tg.smoke_hyperparameters()
    p = tg.init_params(hp, torch.device("cpu"), 0)
    for k in ("mudd_w1", "mudd_w2", "mudd_bias"):
        assert checkpoints.ADDED_PARAMS[k](hp).shape == p[k].shape, k


def test_muon_qk_pairs_flag_and_resume():
    """--muon-qk-pairs (record #80: test_muon_qk_pairs_orthogonalises_each_pair_of_heads_of_w_q_and_w_k) is on by
    default and --no-muon-qk-pairs turns it off (the smoke config has it off); it changes the optimizer's math and
    state (attn_bank's W_q / W_k momentum and second moment in blocks), so --resume refuses it against a checkpoint
    without it, and a checkpoint from before the flag resumes as --no-muon-qk-pairs (checkpoints.ADDED_SETTINGS)."""
    assert tg.Hyperparameters().muon_qk_pairs is True and tg.smoke_hyperparameters().muon_qk_pairs is False
    assert _flags(["--no-muon-qk-pairs"])[1].muon_qk_pairs is False
    assert _flags(["--smoke", "--muon-qk-pairs"])[1].muon_qk_pairs is True
    _check_added_setting_resumes_off("muon_qk_pairs")


def test_ce_grad_in_forward_head_loss_is_the_two_kernel_head(device, monkeypatch):
    """head_loss with grad_in_fwd (the trainer's default on CUDA) gives the loss, dx and dW of the two-kernel path,
    bit for bit, with the trainer's incoming gradient 1 / SLOTS, for the head in the parameters' dtype (fp32 here)
    and, where torch._scaled_mm runs, the FP8 head (bf16): both paths compute the same fp32 values when their
    kernels use one tile and warp count (the interpreter's configuration on the CPU; on a GPU the fused kernel's is
    set to the two kernels'). With an incoming gradient of 1 (the head scales the gradient its forward wrote for
    1 / SLOTS by SLOTS in its backward) dx and dW are SLOTS times those, bit for bit (a power of two). The heads get
    grad_scale = 1 / SLOTS, the gradient train_step gives the loss (another power of two would give the same bits:
    seen here, not in the values), and the FP8 head the two-kernel path's gradient scale."""
    import kernels.cross_entropy as ce
    for dtype, cfg in ce.DEFAULT_CONFIG.items():
        monkeypatch.setitem(ce.FWD_GRAD_CONFIG, dtype, dict(cfg, programs_per_sm=2))
    calls = []
    for name, first in (("head_ce_grad_in_fwd", 4), ("fp8_head_ce_grad_in_fwd", 7)):  # the scalars after the tensors
        op = getattr(tg, name)
        monkeypatch.setattr(tg, name, lambda *a, op=op, name=name, first=first: calls.append((name, a[first:]))
                            or op(*a))
    g = torch.Generator().manual_seed(3)
    N, C, V = 16, 32, 208  # on the CPU one interpreted program per row: 16 rows, the last K - 1 with fewer targets
    t = torch.randint(0, V, (N,), generator=g).to(device)
    wk = torch.tensor([1.0, 0.5, 0.25], device=device)
    heads = [(torch.float32, False)]
    try:
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.T, scale_a=torch.ones((), device=device), scale_b=torch.ones((), device=device),
                         out_dtype=torch.bfloat16)
        heads.append((torch.bfloat16, True))
    except (RuntimeError, NotImplementedError):
        pass
    for dtype, fp8 in heads:
        x = torch.randn(N, C, generator=g).to(device, dtype)
        w = (torch.randn(C, V, generator=g) * 0.05).to(device, dtype)

        def run(grad_in_fwd, upstream):
            xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
            head8 = tg.fp8_head_weights(wa, tg.FP8_W_S) if fp8 else None
            loss = tg.head_loss(xa, wa, t, wk, 23.0, tg.softcapped_cross_entropy, fp8, grad_in_fwd, head8)
            return (loss.detach(),) + torch.autograd.grad(loss, (xa, wa), torch.tensor(upstream, device=device))

        new, old = run(True, 1 / tg.SLOTS), run(False, 1 / tg.SLOTS)
        for name, a, b in zip(("loss", "dx", "dW"), new, old):
            assert torch.equal(a, b), f"{name} differs ({'fp8' if fp8 else dtype} head)"
        for name, a, b in zip(("dx", "dW"), run(True, 1.0)[1:], new[1:]):
            assert torch.equal(a, tg.SLOTS * b), f"{name} with an incoming gradient of 1 ({'fp8' if fp8 else dtype})"
    softcap = (23.0, tg.SOFTCAP_B, tg.SOFTCAP_C)
    want = [("head_ce_grad_in_fwd", (1 / tg.SLOTS, *softcap))] * 2         # two runs with grad_in_fwd per head
    if len(heads) > 1:  # the gradient's scale FP8_GRAD_S / (N * SLOTS), its integer divisor last
        fp8_scales = (tg.FP8_X_S, tg.FP8_W_S, tg.FP8_GRAD_S, 1 / tg.SLOTS, *softcap, N * tg.SLOTS)
        want += [("fp8_head_ce_grad_in_fwd", fp8_scales)] * 2
    assert calls == want, calls


def test_step_kernels_are_the_triton_kernels_on_cuda_and_their_references_on_the_cpu():
    """The optimizer's kernels by device (StepKernels.on only picks functions: no GPU needed to check the choice):
    on CUDA our Triton launchers, the gradient fold included (kernels.accumulate); on the CPU their references."""
    from kernels import accumulate, adam, momentum, normuon, polar_express, transpose
    cuda, cpu = tg.StepKernels.on(torch.device("cuda")), tg.StepKernels.on(torch.device("cpu"))
    assert (cuda.momentum, cuda.polar, cuda.normuon, cuda.adam, cuda.transpose_add, cuda.transpose_copy,
            cuda.accumulate) == (momentum.nesterov_momentum, polar_express.polar_express, normuon.normuon_update,
                                 adam.fused_adamw_multi_step, transpose.transpose_add, transpose.transpose_copy,
                                 accumulate.accumulate_)
    assert (cpu.momentum, cpu.polar, cpu.adam, cpu.accumulate) == (
        momentum.nesterov_momentum_ref, polar_express.polar_express_ref, adam.fused_adamw_multi_step_ref,
        accumulate.accumulate_ref)


def test_checkpoint_saved_line_is_rank_0s_alone(tmp_path):
    """checkpoint_saved_line: on rank 0 the folder's size (every file in it) and the seconds since t0; on any other
    rank None, without looking at the folder, which rank 0 may not have renamed yet (a 2-rank run failed so)."""
    folder = tmp_path / "step_000005"
    folder.mkdir()
    (folder / "rank0.pt").write_bytes(b"x" * (3 * 2**20))
    (folder / "rank1.pt").write_bytes(b"x" * (2 * 2**20))
    line = tg.checkpoint_saved_line(0, folder, time.perf_counter() - 2.0)
    assert re.fullmatch(rf"checkpoint_saved: {re.escape(str(folder))} 5 MiB in 2\.\d s", line), line
    missing = tmp_path / "step_000010"  # rank 0 has not renamed step_000010.tmp yet
    assert tg.checkpoint_saved_line(1, missing, time.perf_counter()) is None


# ----------------------------------------------------------------------------------------------------
# --prefix-loss (record #88's prefix-token loss)


def _merge_encoding():
    """A tiktoken encoding of the 256 bytes and five merges, end-of-text 261: b"ab" 256, b"abc" 257, b"abcd" 258
    (its longest proper prefix that is a token: b"abc"), b"xy" 259, b"xyz" 260."""
    import tiktoken
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"ab": 256, b"abc": 257, b"abcd": 258, b"xy": 259, b"xyz": 260})
    return tiktoken.Encoding(name="merges", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 261})


def test_prefix_token_table_is_the_longest_proper_prefix_token():
    """prefix_token_table on a small encoding, written out: a byte has no proper prefix (-1); ab -> a, abc -> ab,
    abcd -> abc (the longest, not ab or a), xy -> x, xyz -> xy; end-of-text and padding rows -1; a prefix id at or
    beyond the vocabulary is none (-1)."""
    t = tg.prefix_token_table(_merge_encoding(), 264)
    assert t.dtype == torch.int64 and t.shape == (264,)
    expect = torch.full((264,), -1, dtype=torch.int64)
    expect[256], expect[257], expect[258] = ord("a"), 256, 257
    expect[259], expect[260] = ord("x"), 259
    assert torch.equal(t, expect)
    cut = tg.prefix_token_table(_merge_encoding(), 258)  # ids 258 .. 260 are beyond it
    assert cut[256] == ord("a") and cut[257] == 256 and cut.shape == (258,)
    assert torch.equal(tg.prefix_token_table(_merge_encoding(), 257)[256:], torch.tensor([ord("a")]))


@pytest.mark.skipif(_gpt2_cache_dir() is None, reason="tiktoken's gpt2 files are not available offline")
def test_prefix_token_table_on_gpt2(monkeypatch):
    """GPT-2's table (the speedrun's 50304 rows) against a check of every token by tiktoken's own lookup: each
    entry's bytes are a proper prefix of its token's and a token, and no longer proper prefix is a token; -1
    exactly where no proper prefix is (the 256 bytes among them), at end-of-text and in the padding rows."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_gpt2_cache_dir()))
    enc = tg.load_gpt2()
    t = tg.prefix_token_table(enc, 50304).tolist()
    assert t[50256:] == [-1] * 48
    for i in range(50256):
        b = enc.decode_single_token_bytes(i)
        longer = []
        for n in range(1, len(b)):
            try:
                longer.append(enc.encode_single_token(b[:n]))
            except KeyError:
                pass
        assert t[i] == (longer[-1] if longer else -1), i
    assert sum(v < 0 for v in t[:256]) == 256


def test_loss_weights_at_carry_the_prefix_weight_last():
    """--prefix-loss appends record #88's weight to each step's multi-token weights: 0.25 through stage 0, 0.25
    -> 0 over stage 1 (linear), 0 after; without it the weights are the multi-token ones, zero-padded to K."""
    hp = tg.Hyperparameters()
    b = tg.stage_bounds(hp)
    assert tg.loss_weights_at(hp, 0, 3) == tg.mtp_weights_at(hp, 0) == (1.0, 0.5, 0.25)
    assert tg.loss_weights_at(hp, b[2][0], 3) == (1.0, 0.0, 0.0)
    on = dataclasses.replace(hp, prefix_loss=True)
    assert tg.loss_weights_at(on, 0, 3) == (1.0, 0.5, 0.25, 0.25)
    assert tg.loss_weights_at(on, b[0][1] - 1, 3)[3] == 0.25
    s1, e1 = b[1][0], b[1][1]
    assert tg.loss_weights_at(on, s1, 3)[3] == 0.25
    assert tg.loss_weights_at(on, (s1 + e1) // 2, 3)[3] == pytest.approx(0.25 * (1 - ((s1 + e1) // 2 - s1) / (e1 - s1)))
    assert tg.loss_weights_at(on, b[2][0], 3) == (1.0, 0.0, 0.0, 0.0)
    assert tg.loss_weights_at(on, hp.total_steps - 1, 3)[3] == 0.0


def test_prefix_loss_train_step_scores_the_prefix_tokens(monkeypatch):
    """build_fns' train_step with --prefix-loss is the head's loss with (2, T) targets: the next tokens and their
    prefix tokens (prefix_token_table of the encoding load_gpt2 gives), the prefix term weighted by the last
    weight: against the same layers' output scored by an independent float64 sum over the rows."""
    monkeypatch.setattr(tg, "load_gpt2", _merge_encoding)
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=384, bos_id=261, prefix_loss=True,
                                  **TWO_LAYERS)
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False)
    params = _perturbed_params(hp, seed=3)
    with torch.no_grad():  # logits far apart, so that a term scored on the wrong row or column shows
        params["lm_head"].mul_(40.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 262, (129,), generator=g)
    ids[[5, 9, 40, 41]] = torch.tensor([256, 258, 260, 257])  # targets with prefix tokens (and one after BOS)
    ids[0] = 261
    batch = tg.MicroBatch(ids=ids[:-1].to(torch.int32), targets=ids[1:].to(torch.int64))
    w = torch.tensor([1.0, 0.5, 0.25, 0.375])
    windows = tg.windows_at(hp, 0)
    got = tg.forward(hp, params, fns, batch, windows, {}, train=True, mtp=w)
    x = tg.model_inputs(hp, params, fns, batch, windows, {}, None, None)
    h = tg.rms_norm(fns.layers(x.params, x.e, x.ves, x.big, x.ids, x.cu, x.tables)).double()
    z = hp.softcap * torch.sigmoid((h @ params["lm_head"].double() + 5) / 7.5)
    lse = torch.logsumexp(z, dim=1)
    t, pre = batch.targets, tg.prefix_token_table(_merge_encoding(), hp.vocab_size)
    N = len(t)
    total = 0.0
    for r in range(N):
        for k in range(3):
            if r + k < N:
                total += w[k].item() * (lse[r] - z[r, t[r + k]])
        if pre[t[r]] >= 0:
            total += w[3].item() * (lse[r] - z[r, pre[t[r]]])
    assert sum(pre[t] >= 0) >= 4
    torch.testing.assert_close(got.double(), total / N, rtol=1e-5, atol=1e-6)


def test_prefix_loss_flag_and_resume():
    """--prefix-loss is off by default; it changes the loss, so --resume refuses it against a checkpoint without it,
    and a checkpoint from before the flag resumes as --no-prefix-loss (checkpoints.ADDED_SETTINGS)."""
    assert tg.Hyperparameters().prefix_loss is False
    assert _flags(["--smoke", "--prefix-loss"])[1].prefix_loss is True
    _check_added_setting_resumes_off("prefix_loss")
