"""Tests of what train_gpt.py refuses and what it never loses: checkpoints written atomically and checked on load
(a kill -9 inside a save, a damaged file), unfinished saves of stopped runs removed or named (never a live run's),
--keep-last, Ctrl-C before any checkpoint, logs never overwritten (a taken --run-id), every setting checked before
any file is opened (one line naming the flag, exit code 2), --resume refusing a checkpoint of another run,
--vocab-from-data never taking a stray id for the document separator, a run that fails after its log opened
marked in the log, one printed error under torchrun, and ranks that end when torchrun is killed. CPU; in process
except where the process itself (a SIGKILL, torchrun's ranks) is what is tested.
"""
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoints
import cli
import run_log
import train_gpt as tg
from distributed import Dist
from data.shards import shard_files, write_shard
from test_train_gpt import _flags, _make_shard, _smoke_argv

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Smoke shards (BOS 511, vocabulary 512): two training shards and a validation shard."""
    d = tmp_path_factory.mktemp("rel_data")
    _make_shard(d / "smoke_train_000001.bin", 60_000, 1)
    _make_shard(d / "smoke_train_000002.bin", 60_000, 2)
    _make_shard(d / "smoke_val_000000.bin", 20_000, 3)
    return d


def _run_hp(data, *flags):
    """The hyperparameters main() trains with for _smoke_argv(data, ...) plus flags (after fit_to_data)."""
    hp = _flags(_smoke_argv(data, data, "x", *flags))[1]
    return cli.fit_to_data(hp, shard_files(hp.train_files), shard_files(hp.val_files))


@pytest.fixture(scope="module")
def ckpt(data, tmp_path_factory):
    """A complete checkpoint (step 1, save_checkpoint of the initial model) of the run _smoke_argv(data, ...)
    would start."""
    hp, d = _run_hp(data), Dist()
    params = tg.init_params(hp, torch.device("cpu"), hp.seed)
    return checkpoints.save_checkpoint(tmp_path_factory.mktemp("rel_ckpt") / "run", 1, params,
                                       tg.Optimizer(hp, params, d), {"step": 1}, 0.0, d, hp)


def _exit_2(argv, capsys):
    """main(argv) must print one error line and exit with code 2; returns the line."""
    with pytest.raises(SystemExit) as info:
        tg.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("train_gpt.py: error: "), err
    return err.strip()[len("train_gpt.py: error: "):]


# ----------------------------------------------------------------------------------------------------
# Checkpoints: atomic, checked on load


def test_kill_9_inside_a_save_leaves_no_checkpoint_and_load_refuses_the_remains(data, ckpt, tmp_path, capsys):
    """A process killed (SIGKILL) while torch.save writes rank0.pt leaves the earlier checkpoints as they were
    and no step_NNNNNN folder for the interrupted save, only step_NNNNNN.tmp; --sample and --resume on that
    are one line each, and the complete checkpoint still loads."""
    assert [p.name for p in ckpt.parent.iterdir()] == ["step_000001"], "a finished save leaves no .tmp"
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / ckpt.name)
    hp = _run_hp(data)
    params = tg.init_params(hp, torch.device("cpu"), 0)
    opt = tg.Optimizer(hp, params, Dist())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: writes half of rank0.pt, says so, and waits to be killed
        try:
            os.close(r)
            real_save = torch.save

            def half_save(obj, f):
                buf = io.BytesIO()
                real_save(obj, buf)
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
                f.flush()
                os.write(w, b"x")
                time.sleep(60)

            torch.save = half_save
            checkpoints.save_checkpoint(run, 2, params, opt, {"step": 2}, 0.0, Dist(), hp)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x", "the child did not reach torch.save"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    assert sorted(p.name for p in run.iterdir()) == ["step_000001", "step_000002.tmp"]
    assert 0 < (run / "step_000002.tmp" / "rank0.pt").stat().st_size
    tmp = run / "step_000002.tmp"
    assert _exit_2(["--sample", str(tmp)], capsys) == (f"{tmp} is an unfinished checkpoint (its run stopped "
                                                       f"while saving it); use a step_NNNNNN folder")
    out = tmp_path / "resumed"
    assert "is an unfinished checkpoint" in _exit_2(_smoke_argv(data, out, "r", "--resume", str(tmp)), capsys)
    assert not out.exists(), "a refused resume must not open a log"
    tg.load_model(run / "step_000001", Dist())


def test_damaged_checkpoint_file_is_one_line_naming_it(data, ckpt, tmp_path, capsys):
    """A rank file cut short after the save (the disk, a copy) is refused by --sample and --resume with one line
    naming the file and saying what is wrong with it, not torch's "PytorchStreamReader failed" traceback or, from
    --resume's memory-mapped look, its "mmap can only be used with files saved with ..."; so is a file that is no
    checkpoint."""
    folder = tmp_path / "step_000001"
    shutil.copytree(ckpt, folder)
    f = folder / "rank0.pt"
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 10])
    line = _exit_2(["--sample", str(folder)], capsys)  # torch.load reads it whole
    assert line == (f"{f}: damaged checkpoint file: truncated, or not written by torch.save (it is no complete zip "
                    f"archive)"), line
    assert line == _exit_2(_smoke_argv(data, tmp_path, "r", "--resume", str(folder)), capsys)  # memory-mapped
    torch.save([1, 2], f)
    assert _exit_2(["--hellaswag", str(folder)], capsys) == (f"{f}: not a checkpoint of train_gpt.py (no "
                                                             f"hyperparameters in it)")


def _hold_in_child(folder):
    """A child process that holds `folder` as a live run does (hold_run_folder) until it is killed; returns its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            checkpoints.hold_run_folder(folder)
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x", "the child did not take the lock"
    finally:
        os.close(r)
    return pid


def test_unfinished_saves_of_stopped_runs_are_removed_or_named_never_a_live_runs(tmp_path):
    """step_NNNNNN.tmp folders: a live run's (its folder locked by hold_run_folder, here in a child process) is
    neither removed nor named; once that process is killed (kill -9: the kernel drops the lock) it is a stopped
    run's. As a run starts (tidy_checkpoints), those of the run it resumes are removed, the others named in one
    line and left."""
    ckpt = tmp_path / "ckpt"
    for run in ("resumed", "other"):
        (ckpt / run / "step_000002").mkdir(parents=True)
        (ckpt / run / "step_000004.tmp").mkdir()
    live = ckpt / "live"
    pid = _hold_in_child(live)
    try:
        (live / "step_000006.tmp").mkdir()
        assert checkpoints.run_is_live(live) and not checkpoints.run_is_live(ckpt / "other")
        assert checkpoints.unfinished_saves(ckpt) == [ckpt / "other" / "step_000004.tmp",
                                                      ckpt / "resumed" / "step_000004.tmp"]
        lines = []
        args, _ = _flags(["--checkpoint-dir", str(ckpt), "--resume", str(ckpt / "resumed" / "step_000002")])
        checkpoints.tidy_checkpoints(args, lines.append)
        assert lines == [f"removed_unfinished_save: {ckpt / 'resumed' / 'step_000004.tmp'} (left by the run this one "
                         f"continues)",
                         f"unfinished_saves: {ckpt / 'other' / 'step_000004.tmp'} (left by runs stopped while saving; "
                         f"no checkpoint, ignored; delete them)"]
        lines.clear()
        args, _ = _flags(["--checkpoint-dir", str(ckpt), "--resume", str(live / "step_000004")])
        checkpoints.tidy_checkpoints(args, lines.append)  # a live run's checkpoint resumed (a fork): its save stays
        assert (live / "step_000006.tmp").is_dir() and lines[0].startswith(f"unfinished_saves: {ckpt / 'other'}")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not checkpoints.run_is_live(live)
    assert checkpoints.unfinished_saves(ckpt) == [ckpt / "live" / "step_000006.tmp", ckpt / "other" / "step_000004.tmp"]
    assert (ckpt / "resumed" / "step_000002").is_dir() and (ckpt / "other" / "step_000002").is_dir()


def test_keep_last_keeps_the_newest_checkpoints(data, tmp_path):
    """--keep-last N: after each save, the run's folder holds its newest N checkpoints (0: all)."""
    hp, d = _run_hp(data), Dist()
    params = tg.init_params(hp, torch.device("cpu"), hp.seed)
    opt = tg.Optimizer(hp, params, d)
    for keep, left in ((2, ["step_000008", "step_000010"]), (0, [f"step_{s:06d}" for s in (2, 4, 6, 8, 10)]),
                       (1, ["step_000010"])):
        run = tmp_path / f"keep{keep}"
        for step in (2, 4, 6, 8, 10):
            checkpoints.save_checkpoint(run, step, params, opt, {"step": step}, 0.0, d, hp, keep_last=keep)
        assert sorted(p.name for p in run.iterdir()) == left
    tg.load_model(tmp_path / "keep1" / "step_000010", d)


def test_keep_last_help_says_what_a_checkpoint_holds(data, ckpt, capsys):
    """--keep-last's help lists what a checkpoint file holds: every entry save_checkpoint writes, and its size per
    parameter (fp32 master and two Adam moments or Muon's momentum, plus rank 0's bf16 copy: 10 to 14 bytes)."""
    with pytest.raises(SystemExit):
        _flags(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    said = text.split("--keep-last N", 1)[1].split("--log-dir", 1)[0]
    state = torch.load(ckpt / "rank0.pt", weights_only=False)
    described = {"step": "step_NNNNNN", "world_size": "one file per rank", "optimizer": "optimizer state",
                 "loader": "loader's position", "rng": "RNG state", "train_time_ms": "train time",
                 "hyperparameters": "hyperparameters", "run": "run's id and log", "params": "every parameter"}
    assert set(state) == set(described)
    for key, words in described.items():
        assert words in said, (key, said)
    for words in ("fp32 master weights", "Adam's two moments", "Muon's momentum", "10 to 14 bytes per parameter"):
        assert words in said
    n_params = sum(v.numel() for v in state["params"].values())
    assert 10 <= (ckpt / "rank0.pt").stat().st_size / n_params <= 14


def test_ctrl_c_before_any_checkpoint_says_how_to_save_one(data, tmp_path, capsys, monkeypatch):
    """Ctrl-C (here a KeyboardInterrupt from the first training step) in a run without a checkpoint yet: one line
    saying so and naming --save-every, exit code 130, the log ending with it; main() puts back the SIGINT handler
    it found. (The signal itself, its exit and a resume: test_train_gpt's
    test_ctrl_c_is_one_line_and_its_checkpoint_resumes_exactly.)"""
    def interrupted(self, step, want_loss, clock=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(tg.Trainer, "train_step", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as info:
        tg.main(_smoke_argv(data, tmp_path, "early"))
    assert info.value.code == 130
    said = "interrupted at step 0/10; no checkpoint saved yet (--save-every N saves one every N steps)"
    assert capsys.readouterr().err == f"train_gpt.py: {said}\n"
    assert (tmp_path / "logs" / "early.txt").read_text().splitlines()[-1] == f"run_interrupted: {said}"
    assert signal.getsignal(signal.SIGINT) is handler


# ----------------------------------------------------------------------------------------------------
# Logs: never overwritten; the paths printed at start


def test_taken_run_id_is_refused_and_its_log_kept(data, tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "old.txt").write_text("step:1/10 train_time:1ms\n")
    line = _exit_2(_smoke_argv(data, tmp_path, "old"), capsys)
    assert line.startswith(f"--run-id old is taken: {logs / 'old.txt'} exists"), line
    assert (logs / "old.txt").read_text() == "step:1/10 train_time:1ms\n"
    (tmp_path / "ckpt" / "other").mkdir(parents=True)
    assert _exit_2(_smoke_argv(data, tmp_path, "other"), capsys).startswith(
        f"--run-id other is taken: {tmp_path / 'ckpt' / 'other'} exists")
    # The log itself is created, never truncated (a log made after the check, by another process).
    with pytest.raises(FileExistsError):
        run_log.Logger(logs / "old.txt", True)
    assert (logs / "old.txt").read_text() == "step:1/10 train_time:1ms\n"


def test_run_failing_after_its_log_opened_is_marked_failed(data, tmp_path, capsys):
    """Training shards too small for one batch fail in the first step, after the log opened: exit 2, and the
    log (printed at the start with the checkpoint folder) ends with a run_failed: line."""
    small = tmp_path / "small"
    small.mkdir()
    write_shard(small / "s_train_000001.bin", np.tile(np.array([511, 3, 4, 5], dtype=np.uint16), 100))
    argv = _smoke_argv(data, tmp_path, "fails") + ["--train-files", str(small / "s_train_*.bin")]
    with pytest.raises(SystemExit) as info:
        tg.main(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    log = tmp_path / "logs" / "fails.txt"
    assert f"log_file: {log}\ncheckpoint_dir: {tmp_path / 'ckpt' / 'fails'}\n" in out
    assert err.startswith("train_gpt.py: error: training shards") and "too few documents" in err
    assert log.read_text().splitlines()[-1].startswith("run_failed: ShardError: training shards")


# ----------------------------------------------------------------------------------------------------
# Settings: each checked before any file is opened, one line naming the flag


BAD_SETTINGS = [
    (["--ve-tables", "0,1"], "--ve-tables: 2 entries for 4 layers"),
    (["--ve-tables", "0,-2,-1,0"], "--ve-tables: layer 1 has table -2"),
    (["--ve-tables", "1,-1,-1,1"], "--ve-tables: table 0 is used by no layer"),
    (["--no-attn-layers", "3"], "--ve-tables: layer 3 has table 0 but no attention (--no-attn-layers)"),
    (["--skip-from", "9"], "--skip-from: 9 is not a layer index (--num-layers 4: 0 .. 3)"),
    (["--skip-to", "-1"], "--skip-to: -1 is not a layer index"),
    (["--skip-from", "2", "--skip-to", "1"], "--skip-from 2 must come before --skip-to 1"),
    (["--num-heads", "3"], "--num-heads 3 x --head-dim 32 must equal --model-dim 64"),
    (["--num-heads", "1", "--head-dim", "64"], "--num-heads: paired heads need an even number, got 1"),
    (["--xsa", "--paired-head-layers", "0,1,2,3"], "--xsa: every attention layer has paired heads"),
    (["--muon-qk-pairs", "--num-heads", "1", "--head-dim", "64", "--no-paired-heads"],
     "--muon-qk-pairs: splits W_q and W_k into pairs of heads; --num-heads must be even, got 1 (or "
     "--no-muon-qk-pairs)"),
    (["--mudd"], "--mudd: built on record #77's single stream; add --one-stream (or --no-mudd)"),
    (["--mudd", "--one-stream", "--no-backout"], "--mudd: its final mix does the backout"),
    (["--mudd", "--one-stream"], "--mudd: mixes the outputs of --backout-layer and --skip-from into the last two "
                                 "layers, so both must come before layer 2"),  # the smoke's backout layer is 2
    (["--mudd", "--one-stream", "--backout-layer", "1", "--paired-head-layers", "0,3"],
     "--mudd: gates the last layer's (3) value embedding: it needs attention, a value embedding"),
    (["--mudd", "--one-stream", "--backout-layer", "1", "--ve-tables", "0,-1,-1,-1"],
     "--mudd: gates the last layer's (3) value embedding"),
    (["--mudd", "--one-stream", "--backout-layer", "1", "--num-heads", "1", "--head-dim", "64",
      "--no-paired-heads"], "--mudd: its value gate has one channel per half of the heads; --num-heads must be even"),
    (["--model-dim", "60", "--head-dim", "30"], "--head-dim: must be a multiple of 4"),
    (["--param-dtype", "foo"], "--param-dtype: 'foo' is not one of bfloat16, float32"),
    (["--final-long-window", "0"], "--final-long-window: must be >= 1, got 0"),
    (["--no-attn-layers", "99"], "--no-attn-layers: 99 is not a layer index"),
    (["--no-attn-layers", "0,1,2,3", "--ve-tables=-1,-1,-1,-1"], "--no-attn-layers: lists every layer"),
    (["--long-window-layers", "4"], "--long-window-layers: 4 is not a layer index"),
    (["--paired-head-layers", "0,-1"], "--paired-head-layers: -1 is not a layer index"),
    (["--backout-layer", "4"], "--backout-layer: 4 is not a layer index"),
    (["--parallel-start", "5"], "--parallel-start: must be a layer index or 4"),
    (["--cooldown-frac", "2"], "--cooldown-frac: must be in [0, 1], got 2.0"),
    (["--untie-stage", "-1"], "--untie-stage: must be >= 0, got -1"),
    (["--untie-stage", "3"], "--untie-stage: 3 is not a stage with an Adam step to untie after"),
    (["--muon-momentum-min", "0.99"], "--muon-momentum-min 0.99 is above --muon-momentum-max 0.95"),
    (["--adam-lr", "-1"], "--adam-lr: must be >= 0, got -1.0"),
    (["--gate-dims", "65"], "--gate-dims: the gates read 65 dims"),
    (["--val-micro-tokens", "100"], "--val-micro-tokens: must be a multiple of 128"),
    (["--bigram-vocab-size", "1"], "--bigram-vocab-size: must be >= 2, got 1"),
    (["--bos-id", "60000"], "--bos-id: 60000 is not a token id (0 .. 50256)"),
    (["--no-vocab-from-data", "--bos-id", "600"], "--bos-id: 600 is not a token id (0 .. 511)"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--adam-every", "0"], "--adam-every: must be >= 1, got 0"),
    (["--seed", "-1"], "--seed: must be in [0, 18446744073709551615], got -1"),
    (["--seed", str(2**64)], "--seed: must be in [0, 18446744073709551615], got 18446744073709551616"),
    (["--keep-last", "-1"], "--keep-last: must be >= 0, got -1"),
    (["--run-id", "../elsewhere"], "--run-id '../elsewhere': use letters, digits"),
    (["--sample", "ckpt", "--max-new-tokens", "-3"], "--max-new-tokens: must be >= 1, got -3"),
    (["--sample", "ckpt", "--top-k", "-1"], "--top-k: must be >= 0, got -1"),
    (["--sample", "ckpt", "--hellaswag", "ckpt"], "--sample and --hellaswag: give one of them"),
]


@pytest.mark.parametrize("flags, message", BAD_SETTINGS, ids=[" ".join(f) for f, _ in BAD_SETTINGS])
def test_bad_setting_is_one_line_before_any_file(tmp_path, capsys, flags, message):
    """The smoke config (4 layers, 2 heads of 32) with one bad setting and no data: check_settings refuses it
    by name before the shards are looked for or anything is written."""
    argv = _smoke_argv(tmp_path / "no_data", tmp_path, "run", *flags)
    line = _exit_2(argv, capsys)
    assert line.startswith(message), line
    assert list(tmp_path.iterdir()) == [], "nothing may be written before the settings are checked"


# The speedrun's defaults (not the smoke config: record #74's layout) with one setting that a feature on by default
# cannot take: the line names the feature's off flag as a way out too; with the off flags given the layout passes.
DEFAULT_FEATURE_CONFLICTS = [
    (["--no-one-stream"], "--mudd: built on record #77's single stream; add --one-stream (or --no-mudd)",
     ["--no-mudd"]),
    (["--no-backout"], "--mudd: its final mix does the backout (it starts at -0.5 x the backout layer's output); "
                       "leave out --no-backout (or --no-mudd)", ["--no-mudd"]),
    (["--backout-layer", "9"], "--mudd: mixes the outputs of --backout-layer and --skip-from into the last two "
                               "layers, so both must come before layer 9 (or --no-mudd)", ["--no-mudd"]),
    (["--paired-head-layers", "0,2,5,10"], "--mudd: gates the last layer's (10) value embedding: it needs attention, "
                                           "a value embedding (--ve-tables) and no paired heads (or --no-mudd)",
     ["--no-mudd"]),
    # every attention layer paired: the last one too, which MUDD refuses next
    (["--paired-head-layers", "0,1,2,3,4,5,7,8,9,10"], "--xsa: every attention layer has paired heads "
     "(--paired-head-layers), where XSA does not apply; take a layer out of --paired-head-layers (or --no-xsa)",
     ["--no-xsa", "--no-mudd"]),
]


@pytest.mark.parametrize("flags, message, off", DEFAULT_FEATURE_CONFLICTS,
                         ids=[" ".join(f) for f, _, _ in DEFAULT_FEATURE_CONFLICTS])
def test_a_setting_the_default_features_cannot_take_names_their_off_flag(tmp_path, capsys, flags, message, off):
    """One line (exit code 2) before any file, naming the off flag; with the off flags added the layout passes the
    checks (checked as --sample's flags are: no device, no run id)."""
    argv = ["--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt"), *flags]
    assert _exit_2(argv, capsys) == message
    assert list(tmp_path.iterdir()) == [], "nothing may be written before the settings are checked"
    args, hp = _flags([*flags, *off, "--sample", "ckpt"])
    cli.check_settings(hp, args, tg.check_world_size, tg.untie_step, tg.BLOCK)


def test_prefix_loss_without_gpt2_files_is_one_line_before_any_file(tmp_path, capsys, monkeypatch):
    """--prefix-loss reads tiktoken's gpt2 files: where they cannot load (here tiktoken fails as it does offline
    without them), load_gpt2's one line, before the shards are looked for or anything is written."""
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    line = _exit_2(_smoke_argv(tmp_path / "no_data", tmp_path, "run", "--prefix-loss"), capsys)
    assert line.startswith("tiktoken's GPT-2 tokenizer files are missing and cannot be downloaded"), line
    assert list(tmp_path.iterdir()) == []


def test_full_model_without_cuda_is_refused_naming_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: False)
    line = _exit_2(["--train-files", str(tmp_path / "t_*.bin"), "--log-dir", str(tmp_path / "logs")], capsys)
    assert line.startswith("the full model needs a CUDA GPU and torch sees none; use --smoke"), line
    assert list(tmp_path.iterdir()) == []


def test_unsupported_world_size_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    line = _exit_2(_smoke_argv(tmp_path, tmp_path, "w3"), capsys)
    assert line.startswith("world size 3 is not supported") and "--nproc_per_node" in line, line


def test_only_rank_0_prints_an_error(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank fails alike; ranks other than 0 exit with code 2 silently (a bad value and a
    refused setting alike)."""
    monkeypatch.setenv("RANK", "1")
    for flags in (["--steps", "x"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as info:
            tg.main(_smoke_argv(tmp_path, tmp_path, "r1", *flags))
        assert info.value.code == 2
        assert capsys.readouterr().err == ""


def test_torchrun_error_is_printed_once_without_our_traceback(tmp_path):
    """Two gloo ranks under torchrun, both failing after the process group started (no training data): our line
    once, exit code 2 as torchrun's root cause, no traceback from train_gpt.py (torchrun adds its own summary)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "train_gpt.py"), *_smoke_argv(tmp_path / "none", tmp_path, "tr")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    assert text.count("train_gpt.py: error: no shard files match") == 1, text
    assert 'train_gpt.py", line' not in text and "exitcode  : 2" in text, text


def _stat(pid):
    """The fields of /proc/PID/stat after the parenthesised command name: [0] the state, [1] the parent's pid."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _process_ended(pid):
    """True once pid is gone or a zombie (a rank reparented to an init that does not reap)."""
    try:
        return _stat(pid)[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _children_of(pid):
    """Pids of the processes whose parent is pid (torchrun's ranks)."""
    kids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(_stat(proc.name)[1]) == pid:
                kids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
@pytest.mark.parametrize("under_torchrun", [True, False], ids=["torchrun", "no_torchrun"])
def test_a_process_set_to_end_with_its_launcher_ends_when_the_launcher_is_killed(tmp_path, under_torchrun):
    """Spec of distributed.end_with_the_launcher: in a process started by torchrun (TORCHELASTIC_RUN_ID set), in
    a process session of its own as torchrun starts its ranks, the process ends (SIGTERM) when its parent is
    killed with SIGKILL. Without torchrun's variable it is not set, and the process lives on: the control that
    shows the test can see a survivor."""
    child = ("import sys, time; sys.path.insert(0, sys.argv[1]); import distributed; "
             "print(distributed.end_with_the_launcher(), flush=True); time.sleep(120)")
    env = ("env['TORCHELASTIC_RUN_ID'] = 'test'; " if under_torchrun else "env.pop('TORCHELASTIC_RUN_ID', None); ")
    parent = ("import os, subprocess, sys, time; env = dict(os.environ); " + env
              + f"p = subprocess.Popen([sys.executable, '-c', {child!r}, sys.argv[1]], env=env, "
              "start_new_session=True); print(p.pid, flush=True); time.sleep(120)")
    launcher = subprocess.Popen([sys.executable, "-c", parent, str(REPO)], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == str(under_torchrun)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + (10 if under_torchrun else 2)  # the control's survival: 2 s is plenty
        while not _process_ended(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _process_ended(pid) == under_torchrun
    finally:
        launcher.kill()
        if pid is not None and not _process_ended(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_killing_torchrun_ends_its_training_ranks(data, tmp_path):
    """Two gloo ranks training under torchrun (a schedule far longer than the test): torchrun killed with SIGKILL
    (a time limit's kill, a closed job) cannot stop its ranks itself, and they run in sessions of their own; both
    end within seconds all the same, so no rank keeps its device busy after its launcher is gone."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    log = tmp_path / "torchrun.txt"
    with open(log, "w") as out:
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", str(REPO / "train_gpt.py"),
                                     *_smoke_argv(data, tmp_path, "orphan", "--steps", "100000", "--val-every", "0")],
                                    cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        while "step:2/" not in log.read_text() and time.monotonic() < deadline and torchrun.poll() is None:
            time.sleep(0.2)
        assert "step:2/" in log.read_text(), log.read_text()[-2000:]
        ranks = _children_of(torchrun.pid)
        assert len(ranks) == 2, ranks
        torchrun.kill()
        torchrun.wait()
        deadline = time.monotonic() + 20
        while not all(map(_process_ended, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(_process_ended, ranks)), [r for r in ranks if not _process_ended(r)]
    finally:
        torchrun.kill()
        for r in ranks:
            if not _process_ended(r):
                os.kill(r, signal.SIGKILL)


def test_no_rank_leaves_process_group_setup_before_all_have_joined(monkeypatch):
    """The race the torchrun test above can lose: under gloo one rank can return from init_process_group while its
    peer is still connecting, fail at once and close the connection under it. setup_distributed ends with a
    barrier, after the init and before returning, so no rank can act alone before every rank has joined."""
    import distributed
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(distributed.dist, "barrier", lambda *a, **kw: calls.append(("barrier",)))
    d = distributed.setup_distributed()
    assert calls == [("init", "gloo"), ("barrier",)] and d.world == 2
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.setup_distributed()
    assert calls == [], "one process starts no process group and waits for no one"


def test_smoke_help_shows_the_smoke_defaults_and_every_flag_has_help(capsys):
    def help_text(argv):
        with pytest.raises(SystemExit) as info:
            _flags(argv)
        assert info.value.code == 0
        return " ".join(capsys.readouterr().out.split())

    smoke, full = help_text(["--smoke", "--help"]), help_text(["--help"])
    assert "hyperparameters (defaults: the smoke config (--smoke))" in smoke
    assert "transformer blocks (default: 4)" in smoke and "transformer blocks (default: 11)" in full
    assert "(default: from the shards (--vocab-from-data))" in smoke and "--smoke --help shows" in full
    for flag, after, default in (("--run-id RUN_ID", "--checkpoint-dir", "(default: date_time_random"),
                                 ("--checkpoint-dir", "--log-dir", "(default: checkpoints)"),
                                 ("--log-dir", "--resume", "(default: logs)"),
                                 ("--prompt PROMPT", "--max-new-tokens", "(default: 'The')"),
                                 ("--max-new-tokens", "--temperature", "(default: 32)"),
                                 ("--temperature", "--top-k", "(default: 0.0)"),
                                 ("--top-k", "--num-samples", "(default: 0)"),
                                 ("--num-samples", "--compile-cache", "(default: 1)"),
                                 ("--keep-last N", "--log-dir", "(default: 0)")):
        assert default in full.split(flag, 1)[1].split(after, 1)[0], flag
    assert "1.75 x ln(vocab_size) = 18.9 at step 1" in full


# ----------------------------------------------------------------------------------------------------
# --resume: the checkpoint's settings or nothing


@pytest.mark.parametrize("flags, field", [
    (["--model-dim", "128", "--head-dim", "64"], "--model-dim is 64 in the checkpoint, 128 in this run"),
    (["--steps", "12"], "--steps is 8 in the checkpoint, 12 in this run"),
    (["--seed", "1"], "--seed is 0 in the checkpoint, 1 in this run"),
    (["--no-smear"], "--smear is True in the checkpoint, False in this run"),
    (["--xsa"], "--xsa is False in the checkpoint, True in this run"),
    # a flag given is named before the settings it leaves inconsistent (check_settings would name --long-window-layers
    # or --ve-tables) and before the settings that derive from it
    (["--num-layers", "3"], "--num-layers is 4 in the checkpoint, 3 in this run"),
    (["--num-layers", "5"], "--num-layers is 4 in the checkpoint, 5 in this run"),
    (["--long-window-layers", "1,3,4", "--num-layers", "5", "--ve-tables", "0,-1,-1,0,-1"],
     "--num-layers is 4 in the checkpoint, 5 in this run"),
    (["--model-dim", "96", "--head-dim", "48"], "--model-dim is 64 in the checkpoint, 96 in this run"),
])
def test_resume_with_other_settings_is_refused_naming_the_first_field(data, ckpt, tmp_path, capsys, flags, field):
    line = _exit_2(_smoke_argv(data, tmp_path, "r", "--resume", str(ckpt), *flags), capsys)
    assert line == f"--resume {ckpt}: {field}; a resumed run keeps the checkpoint's settings", line
    assert list(tmp_path.iterdir()) == [], "refused before the log opens"


def test_resume_checks_world_size_and_allows_only_what_does_not_change_the_run(data, ckpt, tmp_path):
    checkpoints.check_resume(_run_hp(data, "--val-every", "1", "--save-every", "2", "--no-train-loss"), ckpt, Dist())
    with pytest.raises(checkpoints.CheckpointError, match="the stage table \\(STAGES\\) differs from the checkpoint's"):
        checkpoints.check_resume(tg.dataclasses.replace(_run_hp(data), stages=tg.STAGES), ckpt, Dist())
    state = torch.load(ckpt / "rank0.pt", weights_only=False)
    folder = tmp_path / "step_000001"
    folder.mkdir()
    torch.save({**state, "world_size": 2}, folder / "rank0.pt")
    with pytest.raises(checkpoints.CheckpointError, match="checkpoint written by 2 ranks, this run has 1"):
        checkpoints.check_resume(_run_hp(data), folder, Dist())
    missing = f"no checkpoint at {folder} (expected {folder / 'rank1.pt'})"
    with pytest.raises(checkpoints.CheckpointError, match=re.escape(missing)):
        checkpoints.check_resume(_run_hp(data), folder, Dist(rank=0, world=2))


@pytest.mark.parametrize("extra, refused", [({"ce_fused_transpose": False}, False), ({"ce_fused_transpose": True}, False),
                                            ({"made_up_setting": 1}, True)])
def test_resume_ignores_retired_settings_only(data, ckpt, tmp_path, extra, refused):
    """A checkpoint written before a setting was retired (RETIRED_SETTINGS: --ce-fused-transpose, which changed no
    bit) still resumes; a setting this trainer never had is refused, naming it."""
    state = torch.load(ckpt / "rank0.pt", weights_only=False)
    folder = tmp_path / "step_000001"
    folder.mkdir()
    torch.save({**state, "hyperparameters": {**state["hyperparameters"], **extra}}, folder / "rank0.pt")
    if refused:
        with pytest.raises(checkpoints.CheckpointError,
                           match="--made-up-setting is 1 in the checkpoint, None in this run"):
            checkpoints.check_resume(_run_hp(data), folder, Dist())
    else:
        checkpoints.check_resume(_run_hp(data), folder, Dist())


# ----------------------------------------------------------------------------------------------------
# --vocab-from-data: the separator from the documents, never a stray id


def _docs(n_docs, bos=511, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([[bos], rng.integers(0, 500, size=int(rng.integers(20, 80)))])
                           for _ in range(n_docs)]).astype(np.uint16)


@pytest.mark.parametrize("stray, every", [(60000, None), (50290, 500)])
def test_id_outside_gpt2_is_an_error_naming_file_and_position(tmp_path, capsys, stray, every):
    """A single id 60000, or 50290 every 500 tokens (above GPT-2's 50256 but below the padded 50304): once the
    largest id became bos_id and the run trained with the wrong separator or failed later."""
    tokens = _docs(400)
    if every:
        tokens[123::every] = stray
    else:
        tokens[123] = stray
    write_shard(tmp_path / "d_train_000001.bin", tokens)
    write_shard(tmp_path / "d_val_000000.bin", _docs(100, seed=1))
    argv = ["--smoke", "--train-files", str(tmp_path / "d_train_*.bin"), "--val-files", str(tmp_path / "d_val_*.bin"),
            "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--steps", "1", "--extension-steps", "0", "--val-every", "0"]  # short, should the check go missing
    line = _exit_2(argv, capsys)
    assert line == (f"{tmp_path / 'd_train_000001.bin'}: token id {stray} at position 123 is outside GPT-2's "
                    f"vocabulary of 50257 ids (--vocab-from-data); were these shards made with another tokenizer?")
    assert not (tmp_path / "logs").exists()


def test_separator_is_the_documents_first_token_not_the_largest_id(tmp_path):
    train, val = tmp_path / "t.bin", tmp_path / "v.bin"
    tokens = _docs(200)
    tokens[77] = 600  # a stray id above the separator, inside GPT-2's range
    write_shard(train, tokens)
    write_shard(val, _docs(50, seed=1))
    hp = cli.fit_to_data(tg.smoke_hyperparameters(), [train], [val])
    assert (hp.bos_id, hp.vocab_size) == (511, 640)
    # stated on the command line: used as given (here shards that do not start with a document)
    write_shard(train, tokens[5:])
    hp = cli.fit_to_data(tg.smoke_hyperparameters(), [train], [val], bos_id=511)
    assert (hp.bos_id, hp.vocab_size) == (511, 640)
    message = f"{val}: starts with token id 511, but {train} starts with {int(tokens[5])}: "
    with pytest.raises(tg.ShardError, match=re.escape(message) + ".* state it with --bos-id$"):
        cli.fit_to_data(tg.smoke_hyperparameters(), [train], [val])
