"""Checkpoints of train_gpt.py's runs: saved atomically, read with one-line errors, checked before a resume.

A run's checkpoints live in its own folder CHECKPOINT_DIR/RUN_ID (its run id is never reused), one folder
step_NNNNNN per save with one file rank<r>.pt per rank: that rank's optimizer shard, the loader's position, the RNG
state, the train time, the hyperparameters and the run's id and log; rank 0's also holds every parameter. A save is
written to step_NNNNNN.tmp and renamed once every rank's file is on disk (``save_checkpoint``), so a checkpoint
folder is complete or absent however the run ends. Rank 0 holds an flock on the run folder while it lives
(``hold_run_folder``): a .tmp folder under an unlocked run folder is an unfinished save that nothing reads
(``unfinished_saves``; ``tidy_checkpoints`` removes those of the run a resumed run continues). ``check_resume``
refuses a checkpoint that cannot continue this run (world size, hyperparameters) before anything is built.
"""
import dataclasses
import fcntl
import os
import shutil
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from flags import flag_name


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, damaged or does not fit this run; printed as one line (cli.py)."""


# Hyperparameters a resumed run may change: they change neither the training math nor the data it reads.
RESUME_MAY_DIFFER = ("val_every", "save_every", "log_train_loss", "hellaswag_every", "hellaswag_file",
                     "hellaswag_limit", "profile_steps", "compile", "embed_grad_to_acc", "cpp_wrapper",
                     "dynamic_tokens", "compile_ahead")
# Settings that older checkpoints may hold and this trainer lacks; each changes no bit (--resume ignores them).
RETIRED_SETTINGS = ("ce_fused_transpose",)  # a 2-D e5m2 CE backward
# Settings that older checkpoints lack, each with the value under which this trainer computes what they computed
# (--resume and saved_hyperparameters read a missing one as it, whatever the default), and the parameters of those
# features, which such a checkpoint lacks too: load_checkpoint leaves them at their initial value, the one that
# feature off never reads or changes.
ADDED_SETTINGS = {"xsa": False, "mlp_act_only": False, "one_stream": False, "mudd": False,  # each off
                  "muon_qk_pairs": False, "prefix_loss": False}
ADDED_PARAMS = {  # name -> a value for a checkpoint without it, where its feature is off and it is unread
    "xsa_alpha": lambda hp: torch.zeros(hp.num_layers, hp.num_heads),  # (its init)
    "mudd_bias": lambda hp: torch.zeros(2, 2, 8),
    "mudd_w2": lambda hp: torch.zeros(2, 64, 2, 8),
    "mudd_w1": lambda hp: torch.zeros(2, 64, hp.model_dim),
}


def fsync_dir(path):
    """Make a folder's entries (a new file, a rename) durable: fsync of the folder itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hold_run_folder(folder):
    """Create a run's checkpoint folder (CHECKPOINT_DIR/RUN_ID, at its first save, by rank 0) and hold an exclusive
    flock on it for the rest of this process: the descriptor is never closed, and the kernel drops the lock when the
    process ends, however it ends (kill -9 included). So run_is_live tells a live run's save in progress
    (step_NNNNNN.tmp) from one that a stopped run left behind. On a file system without flock the folder stays
    unlocked (and run_is_live calls every run there live)."""
    Path(folder).mkdir(parents=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)


def run_is_live(folder):
    """Whether the run folder ``folder`` may belong to a live run: a process holds its lock (hold_run_folder), or
    the file system cannot tell (no flock). False for a folder that is gone."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # our own lock, if we get it, goes with the close below
        return False
    except OSError:  # BlockingIOError: held by a live process
        return True
    finally:
        os.close(fd)


def unfinished_saves(checkpoint_dir):
    """The step_NNNNNN.tmp folders in CHECKPOINT_DIR/*/ whose run is not live (run_is_live): saves (or --keep-last
    deletions) that a stopped run never finished. They hold no checkpoint; nothing reads them."""
    return sorted(t for t in Path(checkpoint_dir).glob("*/step_*.tmp") if not run_is_live(t.parent))


def checkpoints_of(folder):
    """The complete checkpoint folders step_NNNNNN of a run folder, oldest first."""
    done = [p for p in Path(folder).glob("step_*") if not p.name.endswith(".tmp")]
    return sorted(done, key=lambda p: int(p.name[len("step_"):]))


def last_checkpoint(ckpt_dir, resume):
    """The newest complete checkpoint of the run (ckpt_dir), else the one it resumed from (resume), else None."""
    done = checkpoints_of(ckpt_dir) if Path(ckpt_dir).is_dir() else []
    return done[-1] if done else resume


def tidy_checkpoints(args, log):
    """Rank 0, as a run starts: with --resume, the unfinished saves (step_NNNNNN.tmp) of the run it continues are
    removed when that run is not live; any other stopped run's in CHECKPOINT_DIR are named in one line and left
    alone (unfinished_saves: a live run's save in progress is neither)."""
    continued = Path(args.resume).parent if args.resume else None
    if continued is not None and not run_is_live(continued):
        for tmp in sorted(continued.glob("step_*.tmp")):
            shutil.rmtree(tmp)
            log(f"removed_unfinished_save: {tmp} (left by the run this one continues)")
    others = unfinished_saves(args.checkpoint_dir)
    if others:
        log(f"unfinished_saves: {', '.join(map(str, others))} (left by runs stopped while saving; no checkpoint, "
            f"ignored; delete them)")


def save_checkpoint(ckpt_dir, step, params, opt, loader_state, train_time_ms, d, hp, log_path=None, keep_last=0):
    """ckpt_dir/step_NNNNNN with one rank<r>.pt per rank (rank 0's also holds the parameters), written
    atomically: every rank writes and fsyncs its file in step_NNNNNN.tmp, and once all have (a barrier) rank 0
    renames the folder. The folder under ckpt_dir belongs to this run (rank 0 locks it, hold_run_folder), so the
    .tmp name needs no suffix. The state also names the run (its id and log_path): a run resumed from it names them
    in its log's header. keep_last > 0: rank 0 then deletes all but the newest keep_last checkpoints of ckpt_dir,
    each renamed to step_NNNNNN.tmp first, so a kill midway leaves no partial folder under a checkpoint's name."""
    path = Path(ckpt_dir) / f"step_{step:06d}"
    tmp = path.with_name(path.name + ".tmp")
    if d.rank == 0:
        if not path.parent.exists():
            hold_run_folder(path.parent)
        tmp.mkdir()
    if d.world > 1:
        dist.barrier()
    state = {"step": step, "world_size": d.world, "optimizer": opt.state_dict(), "loader": loader_state,
             "train_time_ms": train_time_ms, "rng": torch.get_rng_state(),
             "hyperparameters": dataclasses.asdict(hp),
             "run": {"id": path.parent.name, "log": None if log_path is None else str(log_path)}}
    if d.rank == 0:
        state["params"] = {k: v.detach().cpu() for k, v in params.items()}
    with open(tmp / f"rank{d.rank}.pt", "xb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if d.world > 1:
        dist.barrier()
    if d.rank == 0:
        fsync_dir(tmp)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        if keep_last > 0:
            for old in checkpoints_of(path.parent)[:-keep_last]:
                gone = old.with_name(old.name + ".tmp")
                os.rename(old, gone)
                shutil.rmtree(gone)
    return path


def read_checkpoint(path, rank, mmap=False):
    """The state rank `rank` saved in the checkpoint folder `path`, on the CPU; a CheckpointError naming the
    folder or file when it is unfinished, missing or cannot be read. mmap: tensors stay in the file (a cheap
    look at the metadata)."""
    path = Path(path)
    if path.name.endswith(".tmp"):
        raise CheckpointError(f"{path} is an unfinished checkpoint (its run stopped while saving it); use a "
                              f"step_NNNNNN folder")
    f = path / f"rank{rank}.pt"
    if not f.is_file():
        raise CheckpointError(f"no checkpoint at {path} (expected {f})")
    try:
        state = torch.load(f, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError (zip), EOFError or UnpicklingError for a damaged file
        if not zipfile.is_zipfile(f):  # torch.save writes a zip archive, its index at the end: a cut file has none
            raise CheckpointError(f"{f}: damaged checkpoint file: truncated, or not written by torch.save (it is "
                                  f"no complete zip archive)") from None
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise CheckpointError(f"{f}: damaged checkpoint file, torch.load failed ({type(e).__name__}: "
                              f"{reason})") from None
    if not isinstance(state, dict) or "hyperparameters" not in state:
        raise CheckpointError(f"{f}: not a checkpoint of train_gpt.py (no hyperparameters in it)")
    return state


def check_same_settings(path, saved, mine, names):
    """CheckpointError for the first hyperparameter of ``names`` (field names) whose value in this run (mine) is
    not the checkpoint's (saved; one it lacks: ADDED_SETTINGS'), unless RESUME_MAY_DIFFER lets it."""
    for k in names:
        theirs = saved[k] if k in saved else ADDED_SETTINGS.get(k)
        if k not in RESUME_MAY_DIFFER and theirs != mine.get(k):
            what = ("the stage table (STAGES) differs from the checkpoint's" if k == "stages" else
                    f"{flag_name(k)} is {theirs!r} in the checkpoint, {mine.get(k)!r} in this run")
            raise CheckpointError(f"--resume {path}: {what}; a resumed run keeps the checkpoint's settings")


def check_resume_flags(hp, path, given):
    """Before the settings are checked: the hyperparameters given on the command line (given: field names) against
    the --resume checkpoint's, so that a changed --num-layers is named rather than the --long-window-layers it
    leaves out of range. The vocabulary that --vocab-from-data takes from the shards is left to check_resume."""
    saved = read_checkpoint(path, 0, mmap=True)["hyperparameters"]
    derived = ("vocab_size",) if hp.vocab_from_data else ()
    check_same_settings(path, saved, dataclasses.asdict(hp), [k for k in given if k not in derived])


def check_resume(hp, path, d):
    """Refuse (CheckpointError, one line) a --resume checkpoint that cannot continue this run: a rank file
    missing or damaged, another world size, or a hyperparameter (the schedule and the seed included) other than
    this run's, naming the first that differs (those given on the command line were compared first, by
    check_resume_flags); only RESUME_MAY_DIFFER may. Tensors are not read (mmap): this runs before the log opens
    and the model is built. Returns what the resumed run continues: {"checkpoint", "step", "id", "log"} (id and log
    of the run that saved it; for a checkpoint that does not name its run, its folder's name and None)."""
    ck = read_checkpoint(path, 0, mmap=True)
    if ck["world_size"] != d.world:
        raise CheckpointError(f"--resume {path}: checkpoint written by {ck['world_size']} ranks, this run has "
                              f"{d.world}: the sharded optimizer state needs the same world size")
    for r in range(1, d.world):
        read_checkpoint(path, r, mmap=True)
    saved, mine = ck["hyperparameters"], dataclasses.asdict(hp)
    unknown = [k for k in saved if k not in mine and k not in RETIRED_SETTINGS]
    check_same_settings(path, saved, mine, list(mine) + unknown)
    run = ck.get("run") or {"id": Path(path).resolve().parent.name, "log": None}
    return {"checkpoint": str(path), "step": ck["step"], **run}


def load_checkpoint(path, params, opt, d):
    """Load this rank's state (and rank 0's parameters) into params and opt; returns the state. Checked first
    by check_resume. A parameter of ADDED_PARAMS that the checkpoint lacks keeps its value in params (its initial
    one) and its optimizer state its reset one (no gradient reaches it with its feature off); any other is an
    error."""
    mine = read_checkpoint(path, d.rank)
    p0 = mine if d.rank == 0 else read_checkpoint(path, 0)
    missing = [k for k in params if k not in p0["params"] and k not in ADDED_PARAMS]
    if missing:
        raise CheckpointError(f"{path}: no parameter {missing[0]!r} in the checkpoint (written by another version of "
                              f"train_gpt.py)")
    with torch.no_grad():
        for k, v in p0["params"].items():
            params[k].copy_(v)
    opt.load_state_dict(mine["optimizer"])
    torch.set_rng_state(mine["rng"])
    return mine


def saved_hyperparameters(path, state, hyperparameters, stage):
    """The hyperparameters of a checkpoint's state (dataclasses.asdict of the run's: tuples saved as lists), made
    with the classes ``hyperparameters`` and ``stage`` (train_gpt.py's Hyperparameters and Stage). A setting the
    checkpoint lacks is ADDED_SETTINGS' value (what it computed), never the class's default."""
    saved = state["hyperparameters"]

    def tuples(row):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in row.items() if k != "stages"}
    added = {k: v for k, v in ADDED_SETTINGS.items() if k not in saved}
    try:
        return hyperparameters(**added, **tuples(saved), stages=tuple(stage(**tuples(s)) for s in saved["stages"]))
    except TypeError as e:  # a field this code does not know, or lacks
        raise CheckpointError(f"{path}: written by another version of train_gpt.py ({e})") from None
