"""The run's log: the code that ran, the header, and the writer (train_gpt.py's LOG_DIR/RUN_ID.txt).

A log is self-contained: it starts with the source of every repository module the run imported
(``source_dump``: train_gpt.py and the modules beside it, kernels/, data/; never tests/ or benchmarks/), then a
line of 100 '=', the header (``header_lines``: git sha, versions, GPU, world size, corpus, hyperparameters,
nvidia-smi), another line of 100 '=', and the run's events. ``Logger`` writes on rank 0 only and never
overwrites a log.
"""
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import triton

from kernels.hardware import git_sha

REPO = Path(__file__).resolve().parent


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


def header_lines(hp, d, train_files, val_files):
    gpu = (f"{torch.cuda.get_device_name(d.device)} x {d.world}" if d.device.type == "cuda"
           else f"cpu x {d.world}")
    val_sha = hashlib.sha256(Path(val_files[0]).read_bytes()).hexdigest()[:16]
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
        f"corpus: {hp.train_files} (val sha256[:16] {val_sha})",
        f"hyperparameters: {hp_json}",
        f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
        nvidia_smi() if d.device.type == "cuda" else "nvidia-smi: no GPU",
    ]
