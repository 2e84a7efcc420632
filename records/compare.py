"""Compare speedrun records: parse training logs, summarize groups of runs, test claims.

Usage:
    python records/compare.py records/YYYY-MM-DD_Baseline records/YYYY-MM-DD_Candidate \\
        --baseline YYYY-MM-DD_Baseline [--target 3.28] [--json] [--plot curves.png]
    python records/compare.py --group base=a.txt,b.txt --group new=logs/ --baseline base
    python records/compare.py runs/base runs/new --baseline base --at-step 250,500

Each PATH is a log file or a folder of logs (``*.txt`` and ``*.log`` directly inside it, not recursive, so
an ``old_logs/`` subfolder is not mixed in). Default grouping: one group per folder (a file given directly
belongs to the group of its folder); ``--group NAME=PATH[,PATH...]`` (repeatable) names a group explicitly.
Every group other than ``--baseline`` is a candidate.

Log formats understood
----------------------
Both start with the source that ran, then a line of 100 ``=``, a header, another line of 100 ``=``, and the
step lines; anything missing is reported as unknown (``?`` in Markdown, ``null`` in JSON).

* Public modded-nanogpt logs: header lines ``Running Python 3.12.7 (...)``,
  ``Running PyTorch 2.7.0... compiled for CUDA 12.6`` and the ``nvidia-smi`` table (GPU rows like
  ``|   0  NVIDIA H100 80GB HBM3          On  |``; the GPU count is the number of rows).
* This project's ``train_gpt.py``: the concatenated sources (each file begins ``# ===== file: <relpath> =====``),
  then ``key: value`` header lines (``git_sha``, ``python``, ``torch``, ``triton``, ``cuda``,
  ``gpu: NVIDIA H200 x 1``, ``world_size``, ``corpus``, ``hyperparameters: {json}``) as well as the public-style
  lines above. After the header, before the first step line: the compile warmup's lines, among them
  ``compile_warmup_s: S`` (with ``compile_phase:``, ``compile_cache:`` and ``compile_report:`` lines, which are
  not parsed) and, with ``--profile-steps``, per profiled stage: ``profile_stageI: steps A..B, trace ...``, then
  ``profile: N steps, wall W ms, busy B ms ...``, the kernel rows, ``  communication: busy C ms, overlapped O ms
  (P%), exposed E ms`` (absent from older logs) and ``  by category: NAME T ms (P%)  NAME T ms (P%) ...``
  (times are totals over the N profiled steps of rank 0). After the last step line: ``peak memory allocated:
  A MiB reserved: R MiB`` (GPU runs), ``tokens_per_s_per_gpu: N``, ``mfu: P%`` and ``stage_step_avg:
  stage0:Xms stage1:Yms ...`` (the mean step time of each stage, validation excluded).

Console captures: train_gpt.py's console output saved without the source and header block (other lines, then
the ``compile_...`` lines, then the step lines), where some or all lines may begin with an ``<epoch-seconds> ``
timestamp (``1795691634.121215 step:250/1490 val_loss:1.5441 ...``, the team's side-by-side script). Without a
line of 100 ``=`` such a file is read from its first line (source hash and header unknown, so it never counts in
the statistics of finished runs; ``--at-step`` counts it). A leading timestamp (digits, a dot, digits, a space)
is removed from every line after the source before parsing.

Step lines: ``step:125/1385 val_loss:4.3930 train_time:14290ms step_avg:124.26ms`` (validation) and
``step:126/1385 train_time:14311ms step_avg:123.37ms`` (training). ``train_loss:X`` is in the training lines of
``train_gpt.py --train-loss`` runs, last (``... step_avg:123.37ms train_loss:X``), and of older public logs,
before ``train_time``; the fields are read in any order. ``step_avg:nanms`` occurs early in public logs, whose
last line is ``peak memory allocated: A MiB reserved: R MiB``.

Definitions
-----------
* Source hash: sha256 of the text before the first ``=`` line, first 10 hex digits.
* A run is *finished* when it has a validation line at step == total steps. Its train time and step_avg are
  those of that final validation line: both trainers stop the clock during validation, so this is the
  training time to the final weights. Unfinished runs and runs without a final validation loss are listed but
  excluded from all statistics.
* A file that cannot be parsed at all (empty, binary, not UTF-8, no step line) is reported and skipped; it
  never stops the comparison. A step line cut short (e.g. a log truncated mid-write) is not used and is
  reported with the run.
* Record rule: the mean final val loss must be below ``--target``, shown by the one-sided one-sample t-test
  ``scipy.stats.ttest_1samp(losses, target, alternative="less")`` with p < 0.01, over at least 5 runs.
* Runs needed: the smallest n >= 2 with ``t.cdf((m - target) / (s / sqrt(n)), n - 1) < 0.01``, i.e. the number
  of runs at which the test would reach p < 0.01 if later runs kept the observed mean m and sample std s
  (a plug-in estimate, not a power analysis: with the true mean equal to m about half of such samples would
  miss). "never" when m >= target.
* Candidate vs baseline: time delta (candidate - baseline, seconds and % of the baseline mean), speedup
  (baseline mean / candidate mean), Welch's t-test on times (two-sided, plus the one-sided p that the
  candidate is faster), loss delta with its two-sided Welch p.
* Val loss at equal steps (``--at-step 250,500``, comma-separated integers >= 0): per group and step, the val
  losses of the validation lines at exactly that step, from every run that has one, finished or not, with or
  without a header (unfinished runs stay excluded from the statistics above). n, mean, sample std, min, max,
  the number of the group's runs without a finite val loss at that step (listed, not counted), and for
  candidates the delta (candidate mean - baseline mean) with its two-sided Welch p
  (``scipy.stats.ttest_ind(..., equal_var=False)``; unknown when either side has fewer than 2 runs). A run
  with two validation lines at one step (a resumed log) counts its last one and is warned about. In the
  JSON: ``at_step``, one object per (group, step).

Exit status: 0 when at least one run is usable (finished, with a final val loss) or, with ``--at-step``, has a
val loss at one of the steps; 1 when none is; 2 for usage errors (unknown ``--baseline``, bad ``--group``,
bad ``--at-step``, unwritable ``--plot`` file, a PATH or ``--group`` member that does not exist: one line before
any table).
"""
import argparse
import hashlib
import json
import math
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SEPARATOR = "=" * 100
DEFAULT_TARGET = 3.28
# The public speedrun's significance rule for a new record.
P_THRESHOLD = 0.01
# Fewer runs than this make the t-test's normality assumption and the std estimate too fragile to trust.
MIN_RUNS = 5
LOG_SUFFIXES = (".txt", ".log")
HASH_CHARS = 10

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# Step lines, the one format of train_gpt.py and of the public speedrun's logs:
#     step:S/T key:value key:value ...
# with the fields below in any order (our trainer writes train_loss last, older public logs before
# train_time). train_time and step_avg are required; a line that starts with "step:" but is not a complete
# step line (a missing required field, a field without its unit, an unknown or repeated key: e.g. a log cut
# mid-write) is treated as cut short. parse_step_line is the only parser of this format (the tests use it too).
# Evaluation lines share the head and carry only evaluation fields, no times (the clock is stopped):
#     step:S/T hellaswag_acc_norm:0.2950        (train_gpt.py --hellaswag-every)
_STEP_HEAD_RE = re.compile(r"^step:(?P<step>\d+)/(?P<total>\d+)$")
STEP_FIELDS = {  # key -> unit suffix of its value
    "val_loss": "",
    "train_loss": "",
    "train_time": "ms",
    "step_avg": "ms",
    "hellaswag_acc_norm": "",
}
STEP_REQUIRED = ("train_time", "step_avg")
EVAL_FIELDS = ("hellaswag_acc_norm",)  # a line of only these is an evaluation line (no times required)
_STEP_VALUE_RE = re.compile(rf"^{_NUM}$")
# A console capture's line prefix: epoch seconds with a fraction, then one space.
TIMESTAMP_RE = re.compile(r"^\d+\.\d+ ")


def parse_step_line(line):
    """``{"step": int, "total": int, key: str value, ...}`` for a complete step line, else None.

    Values are kept as text without their unit (``"12.34"``, ``"nan"``); ``_float`` converts them.
    """
    head, *fields = line.split() or [""]
    match = _STEP_HEAD_RE.match(head)
    if not match:
        return None
    out = {"step": int(match.group("step")), "total": int(match.group("total"))}
    for item in fields:
        key, sep, value = item.partition(":")
        unit = STEP_FIELDS.get(key)
        if not sep or unit is None or key in out or not value.endswith(unit):
            return None
        value = value[:len(value) - len(unit)] if unit else value
        if not _STEP_VALUE_RE.match(value):
            return None
        out[key] = value
    keys = set(out) - {"step", "total"}
    evaluation = bool(keys) and keys <= set(EVAL_FIELDS)
    if not evaluation and (any(key not in out for key in STEP_REQUIRED) or keys & set(EVAL_FIELDS)):
        return None
    return out


PEAK_MEM_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB\s*$")
STAGE_AVG_RE = re.compile(rf"^stage(\d+):({_NUM})ms$")
PROFILE_STAGE_RE = re.compile(r"^profile_stage(\d+): steps (\d+)\.\.(\d+)")
PROFILE_HEAD_RE = re.compile(rf"^profile: (\d+) steps, wall ({_NUM}) ms, busy ({_NUM}) ms")
PROFILE_COMM_RE = re.compile(rf"^  communication: busy ({_NUM}) ms, overlapped ({_NUM}) ms \(({_NUM})%\), "
                             rf"exposed ({_NUM}) ms")
PROFILE_CATEGORY_RE = re.compile(rf"([a-z/]+) ({_NUM}) ms \(({_NUM})%\)")
RUNNING_PYTHON_RE = re.compile(r"^Running Python (\S+)")
RUNNING_TORCH_RE = re.compile(r"^Running PyTorch (\S+) compiled for CUDA (\S+)")
SMI_GPU_RE = re.compile(r"^\|\s+\d+\s+(NVIDIA .+?)\s+(?:On|Off)\s+\|")
GPU_FIELD_RE = re.compile(r"^(?P<model>.+?)\s+x\s*(?P<count>\d+)\s*$")
KEY_VALUE_RE = re.compile(r"^(?P<key>[a-z_]+):\s*(?P<value>.*?)\s*$")
HEADER_KEYS = ("git_sha", "python", "torch", "triton", "cuda", "gpu", "world_size", "corpus", "hyperparameters")
FOOTER_KEYS = ("tokens_per_s_per_gpu", "mfu", "compile_warmup_s")


class LogError(Exception):
    """A file that cannot be read as a training log at all."""


@dataclass
class Run:
    path: str
    group: str = ""
    source_hash: str | None = None
    git_sha: str | None = None
    python: str | None = None
    torch: str | None = None
    triton: str | None = None
    cuda: str | None = None
    gpu_model: str | None = None
    gpu_count: int | None = None
    world_size: int | None = None
    corpus: str | None = None
    hyperparameters: dict | str | None = None
    total_steps: int | None = None
    last_step: int | None = None            # highest step of any complete step line
    finished: bool = False                  # a validation line at step == total_steps exists
    val_loss: float | None = None           # final val loss (None unless finished)
    train_time_s: float | None = None       # train_time of the final validation line
    step_avg_ms: float | None = None        # step_avg of the final validation line
    peak_mem_allocated_mib: int | None = None
    peak_mem_reserved_mib: int | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu_pct: float | None = None
    compile_warmup_s: float | None = None
    stage_step_avg_ms: dict = field(default_factory=dict)  # {stage index: mean step ms} (stage_step_avg line)
    # {stage index: {"steps", "wall_ms", "busy_ms", "categories": {name: ms}, "communication": {"busy_ms",
    # "overlapped_ms", "exposed_ms"}}}: the --profile-steps tables (totals over the profiled steps)
    profile: dict = field(default_factory=dict)
    hellaswag_acc_norm: float | None = None  # HellaSwag acc_norm of the evaluation line at the final step
    val_curve: list = field(default_factory=list)     # [(step, train_time_ms, val_loss)]
    hellaswag_curve: list = field(default_factory=list)  # [(step, acc_norm)], logs with evaluation lines
    train_losses: list = field(default_factory=list)  # [(step, train_loss)], logs with train losses
    problems: list = field(default_factory=list)      # why the run is unusable or suspicious

    @property
    def usable(self):
        return self.finished and self.val_loss is not None and math.isfinite(self.val_loss) \
            and self.train_time_s is not None

    @property
    def name(self):
        return Path(self.path).name

    @property
    def hardware(self):
        if self.gpu_model is None:
            return None
        return f"{self.gpu_model} x {self.gpu_count}" if self.gpu_count is not None else self.gpu_model


# ----------------------------------------------------------------------------------------------------------
# Parsing


def _float(text):
    """Float of a log number; None for nan (public logs print step_avg:nanms before timing starts)."""
    value = float(text)
    return None if math.isnan(value) else value


def _number(text):
    try:
        return float(text.rstrip("%").strip())
    except ValueError:
        return None


def parse_log_text(text, path="<text>"):
    """Parse one log's text into a Run; raise LogError when it holds no usable step line at all. A leading
    ``<epoch-seconds> `` is removed from every line after the source (console captures)."""
    if not text.strip():
        raise LogError("empty file")
    lines = text.splitlines()
    separators = [i for i, line in enumerate(lines) if line.rstrip() == SEPARATOR]
    run = Run(path=str(path))
    if separators:
        source = "\n".join(lines[:separators[0]]) + "\n"
        run.source_hash = hashlib.sha256(source.encode("utf-8")).hexdigest()[:HASH_CHARS]
        body_start = separators[0] + 1
    else:
        run.problems.append("no line of 100 '=': source and header unknown")
        body_start = 0
    body = [TIMESTAMP_RE.sub("", line, count=1) for line in lines[body_start:]]
    step_matches = []
    smi_gpus = []
    header_done = False
    cut_lines = 0
    profile = None  # the --profile-steps table being read
    for line in body:
        if line.startswith("step:"):
            header_done = True
            match = parse_step_line(line)
            if match and "hellaswag_acc_norm" in match:
                run.hellaswag_curve.append((match["step"], _float(match["hellaswag_acc_norm"])))
                if match["step"] == match["total"]:
                    run.hellaswag_acc_norm = _float(match["hellaswag_acc_norm"])
            elif match:
                step_matches.append(match)
            else:
                cut_lines += 1
            continue
        if line.rstrip() == SEPARATOR:
            continue
        match = PEAK_MEM_RE.match(line)
        if match:
            run.peak_mem_allocated_mib, run.peak_mem_reserved_mib = int(match.group(1)), int(match.group(2))
            continue
        if line.startswith("stage_step_avg:"):
            for item in line.split()[1:]:
                match = STAGE_AVG_RE.match(item)
                if match:
                    run.stage_step_avg_ms[int(match.group(1))] = _float(match.group(2))
            continue
        match = PROFILE_STAGE_RE.match(line)
        if match:
            profile = run.profile.setdefault(int(match.group(1)), {})
            continue
        if profile is not None and _profile_line(profile, line):
            continue
        match = KEY_VALUE_RE.match(line)
        if match and match.group("key") in FOOTER_KEYS:
            value = _number(match.group("value"))
            setattr(run, "mfu_pct" if match.group("key") == "mfu" else match.group("key"), value)
            continue
        if header_done:
            continue
        # Header lines: only before the first step line, so nothing printed later can masquerade as one.
        if match and match.group("key") in HEADER_KEYS:
            _set_header_field(run, match.group("key"), match.group("value"))
            continue
        match = RUNNING_PYTHON_RE.match(line)
        if match:
            run.python = run.python or match.group(1)
            continue
        match = RUNNING_TORCH_RE.match(line)
        if match:
            run.torch = run.torch or match.group(1)
            run.cuda = run.cuda or match.group(2)
            continue
        match = SMI_GPU_RE.match(line)
        if match:
            smi_gpus.append(match.group(1))
    if not step_matches:
        raise LogError("no complete step line" + (f" ({cut_lines} cut short)" if cut_lines else ""))
    if cut_lines:
        run.problems.append(f"{cut_lines} step line(s) cut short or malformed, ignored")
    if run.gpu_model is None and smi_gpus:
        run.gpu_model = " + ".join(sorted(set(smi_gpus)))
        # nvidia-smi lists every GPU of the machine; world_size, when logged, says how many were used.
        run.gpu_count = run.world_size if run.world_size is not None else len(smi_gpus)
    _fill_steps(run, step_matches)
    return run


def _profile_line(profile, line):
    """Read one line of a --profile-steps table into ``profile`` (see Run.profile); False if it is none of its
    summary lines (the kernel rows are not kept: the trace has them)."""
    match = PROFILE_HEAD_RE.match(line)
    if match:
        profile.update(steps=int(match.group(1)), wall_ms=_float(match.group(2)), busy_ms=_float(match.group(3)))
        return True
    match = PROFILE_COMM_RE.match(line)
    if match:
        profile["communication"] = dict(busy_ms=_float(match.group(1)), overlapped_ms=_float(match.group(2)),
                                        exposed_ms=_float(match.group(4)))
        return True
    if line.startswith("  by category: "):
        profile["categories"] = {m.group(1): _float(m.group(2))
                                 for m in PROFILE_CATEGORY_RE.finditer(line[len("  by category: "):])}
        return True
    return False


def _set_header_field(run, key, value):
    if key == "gpu":
        match = GPU_FIELD_RE.match(value)
        run.gpu_model, run.gpu_count = (match.group("model"), int(match.group("count"))) if match else (value, None)
    elif key == "world_size":
        run.world_size = int(value) if value.isdigit() else None
    elif key == "hyperparameters":
        try:
            run.hyperparameters = json.loads(value)
        except json.JSONDecodeError:
            run.hyperparameters = value
            run.problems.append("hyperparameters line is not valid JSON")
    elif key == "python":
        run.python = value.split()[0] if value else None
    else:
        setattr(run, key, value or None)


def _fill_steps(run, step_matches):
    last = step_matches[-1]
    run.total_steps = last["total"]
    run.last_step = max(m["step"] for m in step_matches)
    final_val = None
    for m in step_matches:
        step = m["step"]
        if m.get("val_loss") is not None:
            loss = _float(m["val_loss"])
            run.val_curve.append((step, _float(m["train_time"]), loss))
            if step == m["total"]:
                final_val = m
        if m.get("train_loss") is not None:
            run.train_losses.append((step, _float(m["train_loss"])))
    if not run.val_curve:
        run.problems.append("no validation line")
    if final_val is None:
        run.problems.append(f"unfinished: last step {run.last_step}/{run.total_steps} has no final val loss")
        return
    run.finished = True
    run.val_loss = _float(final_val["val_loss"])
    train_time_ms = _float(final_val["train_time"])
    run.train_time_s = None if train_time_ms is None else train_time_ms / 1000.0
    run.step_avg_ms = _float(final_val["step_avg"])
    if run.val_loss is None or not math.isfinite(run.val_loss):
        run.problems.append("final val loss is not finite")


def parse_log(path):
    """Read and parse one file; raise LogError for anything that is not a readable training log."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LogError(f"cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise LogError("empty file")
    if b"\x00" in data:
        raise LogError("binary content (NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LogError(f"not UTF-8 text (binary?) at byte {exc.start}") from None
    return parse_log_text(text, path)


# ----------------------------------------------------------------------------------------------------------
# Collecting files into groups


def _log_files(path):
    """The log files of a path: the file itself, or *.txt/*.log directly inside a folder; ValueError for a path
    that does not exist."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in LOG_SUFFIXES)
    return [path]


def _default_group_names(folders):
    """Folder basename as group name, or the full path where two folders share a basename."""
    names = {}
    counts = {}
    for folder in folders:
        counts[folder.name] = counts.get(folder.name, 0) + 1
    for folder in folders:
        names[folder] = folder.name if counts[folder.name] == 1 and folder.name else str(folder)
    return names


def collect_groups(paths, group_specs):
    """Map group name -> list of files, explicit ``--group`` specs first, in command-line order.

    Raises ValueError for a malformed spec or a path that does not exist (before anything is parsed or printed).
    """
    groups = {}
    for spec in group_specs:
        name, sep, members = spec.partition("=")
        if not sep or not name.strip() or not members.strip():
            raise ValueError(f"--group expects NAME=PATH[,PATH...], got {spec!r}")
        files = groups.setdefault(name.strip(), [])
        for member in members.split(","):
            if member.strip():
                files.extend(_log_files(member.strip()))
    folders = []
    by_folder = {}
    for raw in paths:
        path = Path(raw)
        folder = path if path.is_dir() else path.parent
        if folder not in by_folder:
            folders.append(folder)
            by_folder[folder] = []
        by_folder[folder].extend(_log_files(path))
    names = _default_group_names(folders)
    for folder in folders:
        groups.setdefault(names[folder], []).extend(by_folder[folder])
    # A file named twice in one group (folder and file both given) counts once.
    return {name: list(dict.fromkeys(files)) for name, files in groups.items()}


# ----------------------------------------------------------------------------------------------------------
# Statistics


def _stats():
    """scipy.stats, imported by the statistics that use it: reading and tabling logs goes without (a second)."""
    from scipy import stats
    return stats


def runs_needed(mean, std, target, alpha=P_THRESHOLD, max_runs=10**9):
    """Smallest n >= 2 at which the one-sided t-test reaches p < alpha, keeping the observed mean and std.

    p(n) = t.cdf((mean - target) / (std / sqrt(n)), df=n-1) < alpha  <=>  d*sqrt(n) + t.ppf(alpha, n-1) > 0
    with d = (target - mean) / std > 0. Both terms grow with n, so the condition is monotone and a doubling
    search followed by bisection finds the smallest n. Returns "never" when mean >= target, None when std is
    unknown, and 2 when std == 0 (the statistic is infinite for any n).
    """
    if mean is None or std is None or not math.isfinite(mean) or not math.isfinite(std):
        return None
    if mean >= target:
        return "never"
    if std == 0:
        return 2
    d = (target - mean) / std

    stats = _stats()

    def reaches(n):
        return d * math.sqrt(n) + stats.t.ppf(alpha, n - 1) > 0

    hi = 2
    while not reaches(hi):
        if hi >= max_runs:
            return "never"
        hi *= 2
    lo = max(2, hi // 2)
    if reaches(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _quiet(fn, *args, **kwargs):
    """Call a scipy test; degenerate samples (zero variance) give NaN, which we report as None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fn(*args, **kwargs)
    p = float(result.pvalue)
    return None if math.isnan(p) else p


def _std(values):
    return float(np.std(values, ddof=1)) if len(values) >= 2 else None


def group_stats(runs, target):
    """Statistics of a group's usable runs (see the module docstring for each definition)."""
    usable = [r for r in runs if r.usable]
    losses = [r.val_loss for r in usable]
    times = [r.train_time_s for r in usable]
    n = len(usable)
    out = dict(n=n, n_excluded=len(runs) - n, target=target,
               total_steps=sorted({r.total_steps for r in usable}),
               loss_mean=float(np.mean(losses)) if n else None, loss_std=_std(losses),
               p_below_target=None, runs_needed=None,
               time_mean_s=float(np.mean(times)) if n else None, time_std_s=_std(times),
               time_median_s=float(np.median(times)) if n else None,
               time_min_s=min(times) if n else None, time_max_s=max(times) if n else None)
    if n >= 2:
        out["p_below_target"] = _quiet(_stats().ttest_1samp, losses, target, alternative="less")
        out["runs_needed"] = runs_needed(out["loss_mean"], out["loss_std"], target)
    return out


def compare_to_baseline(candidate_runs, baseline_runs):
    """Candidate minus baseline on time and loss, with Welch's t-tests."""
    cand = [r for r in candidate_runs if r.usable]
    base = [r for r in baseline_runs if r.usable]
    out = dict(time_delta_s=None, time_delta_pct=None, speedup=None, p_time_two_sided=None,
               p_time_candidate_faster=None, loss_delta=None, p_loss_two_sided=None)
    if not cand or not base:
        return out
    ct, bt = [r.train_time_s for r in cand], [r.train_time_s for r in base]
    cl, bl = [r.val_loss for r in cand], [r.val_loss for r in base]
    out["time_delta_s"] = float(np.mean(ct) - np.mean(bt))
    out["time_delta_pct"] = 100.0 * out["time_delta_s"] / float(np.mean(bt))
    out["speedup"] = float(np.mean(bt) / np.mean(ct))
    out["loss_delta"] = float(np.mean(cl) - np.mean(bl))
    if len(cand) >= 2 and len(base) >= 2:
        stats = _stats()
        out["p_time_two_sided"] = _quiet(stats.ttest_ind, ct, bt, equal_var=False)
        out["p_time_candidate_faster"] = _quiet(stats.ttest_ind, ct, bt, equal_var=False, alternative="less")
        out["p_loss_two_sided"] = _quiet(stats.ttest_ind, cl, bl, equal_var=False)
    return out


def val_losses_at(run, step):
    """The val losses of a run's validation lines at exactly ``step`` (usually one; none when it lacks it)."""
    return [loss for s, _, loss in run.val_curve if s == step]


def at_step_stats(groups, steps, baseline=None):
    """Val loss at equal steps: one dict per (group, step), baseline first (see the module docstring)."""
    order = ([baseline] if baseline else []) + [g for g in groups if g != baseline]
    rows, warned = [], []
    values = {}  # (group, step) -> losses of the runs counted
    for name in order:
        for step in steps:
            losses, lacking = [], []
            for run in groups[name]:
                at = val_losses_at(run, step)
                if len(at) > 1:
                    warned.append(f"group {name}: {run.name} has {len(at)} validation lines at step {step}: "
                                  f"the last ({_fmt(at[-1], '.4f')}) is counted")
                if at and at[-1] is not None and math.isfinite(at[-1]):
                    losses.append(at[-1])
                else:
                    lacking.append(run.name)
            values[name, step] = losses
            n = len(losses)
            rows.append(dict(group=name, step=step, n=n, n_lacking=len(lacking), lacking=lacking,
                             loss_mean=float(np.mean(losses)) if n else None, loss_std=_std(losses),
                             loss_min=min(losses) if n else None, loss_max=max(losses) if n else None,
                             loss_delta=None, p_loss_two_sided=None))
    if baseline:
        for row in rows:
            base = values[baseline, row["step"]]
            cand = values[row["group"], row["step"]]
            if row["group"] == baseline or not base or not cand:
                continue
            row["loss_delta"] = float(np.mean(cand) - np.mean(base))
            if len(cand) >= 2 and len(base) >= 2:
                row["p_loss_two_sided"] = _quiet(_stats().ttest_ind, cand, base, equal_var=False)
    return rows, warned


# ----------------------------------------------------------------------------------------------------------
# Warnings


def _loss_signature(run):
    """The loss sequences of a run; two independent runs (different seeds) never share them."""
    val = tuple((step, loss) for step, _, loss in run.val_curve)
    return val, tuple(run.train_losses)


def identical_pairs(runs):
    """Pairs of runs with identical loss sequences (at least two validation or train-loss points)."""
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            sig_a, sig_b = _loss_signature(a), _loss_signature(b)
            if sig_a == sig_b and (len(sig_a[0]) >= 2 or len(sig_a[1]) >= 2):
                pairs.append((a, b))
    return pairs


def _mixed(runs, attr):
    values = sorted({str(getattr(r, attr)) for r in runs if getattr(r, attr) is not None})
    return values if len(values) > 1 else None



# Fields that legitimately differ between repeats of one configuration: repeats use different seeds.
RUN_LEVEL_HPARAMS = ("seed",)


def _comparable_hparams(h):
    """The hyperparameters that define a configuration (a dict without run-level fields, or the raw text)."""
    return {k: v for k, v in h.items() if k not in RUN_LEVEL_HPARAMS} if isinstance(h, dict) else h

def group_warnings(name, runs):
    out = []
    usable = [r for r in runs if r.usable]
    for label, attr in (("hardware", "hardware"), ("torch versions", "torch"), ("triton versions", "triton"),
                        ("CUDA versions", "cuda"), ("source hashes", "source_hash"), ("corpora", "corpus"),
                        ("total steps", "total_steps")):
        values = _mixed(runs, attr)
        if values:
            out.append(f"group {name}: mixed {label}: {', '.join(values)}")
    hparams = {json.dumps(_comparable_hparams(r.hyperparameters), sort_keys=True)
               for r in runs if r.hyperparameters is not None}
    if len(hparams) > 1:
        out.append(f"group {name}: mixed hyperparameters ({len(hparams)} distinct settings)")
    for a, b in identical_pairs(runs):
        out.append(f"group {name}: {a.name} and {b.name} have identical loss sequences "
                   f"(same-seed repeats are not independent runs)")
    for r in runs:
        if not r.usable:
            out.append(f"group {name}: {r.name} excluded from statistics: {'; '.join(r.problems) or 'unusable'}")
        elif r.problems:
            out.append(f"group {name}: {r.name}: {'; '.join(r.problems)}")
    if len(usable) < MIN_RUNS:
        out.append(f"group {name}: only {len(usable)} usable run(s), fewer than {MIN_RUNS}: "
                   f"the p < {P_THRESHOLD} claim needs >= {MIN_RUNS} runs")
    return out


def cross_group_warnings(groups, baseline):
    out = []
    group_of = {id(r): name for name, runs in groups.items() for r in runs}
    all_runs = [r for runs in groups.values() for r in runs]
    for a, b in identical_pairs(all_runs):
        if group_of[id(a)] != group_of[id(b)]:
            out.append(f"{a.name} ({group_of[id(a)]}) and {b.name} ({group_of[id(b)]}) have identical loss "
                       f"sequences (same-seed repeats are not independent runs)")
    names = list(groups)
    if baseline is not None:
        for name in names:
            if name == baseline:
                continue
            for label, attr in (("hardware", "hardware"), ("torch", "torch"), ("triton", "triton"),
                                ("CUDA", "cuda"), ("corpus", "corpus")):
                base_values = {getattr(r, attr) for r in groups[baseline]} - {None}
                cand_values = {getattr(r, attr) for r in groups[name]} - {None}
                if base_values and cand_values and base_values != cand_values:
                    out.append(f"{name} vs baseline {baseline}: {label} differs "
                               f"({', '.join(map(str, sorted(cand_values)))} vs "
                               f"{', '.join(map(str, sorted(base_values)))})")
    return out


# ----------------------------------------------------------------------------------------------------------
# Report


def analyze(groups, skipped, target, baseline=None, at_steps=None):
    """Everything the report shows, as plain data (the JSON output); ``at_step`` only with ``at_steps``."""
    order = ([baseline] if baseline else []) + [g for g in groups if g != baseline]
    result = dict(target=target, p_threshold=P_THRESHOLD, min_runs=MIN_RUNS, baseline=baseline,
                  runs_needed_method=("smallest n >= 2 with t.cdf((mean - target) / (std / sqrt(n)), n - 1) "
                                      f"< {P_THRESHOLD}, keeping the observed mean and sample std; "
                                      "'never' when mean >= target"),
                  time_convention="train_time of the final validation line (clock stopped during validation)",
                  groups=[], comparisons=[], warnings=[], skipped=[dict(path=p, reason=r) for p, r in skipped])
    for name in order:
        runs = groups[name]
        entry = dict(name=name, **group_stats(runs, target))
        entry["runs"] = [dict(asdict(r), name=r.name, usable=r.usable, hardware=r.hardware) for r in runs]
        result["groups"].append(entry)
        result["warnings"].extend(group_warnings(name, runs))
    result["warnings"].extend(cross_group_warnings(groups, baseline))
    if baseline:
        for name in order[1:]:
            result["comparisons"].append(dict(candidate=name, baseline=baseline,
                                              **compare_to_baseline(groups[name], groups[baseline])))
    if at_steps:
        result["at_step"], at_warnings = at_step_stats(groups, at_steps, baseline)
        result["warnings"].extend(at_warnings)
    return result


def json_safe(value):
    """Replace non-finite floats (a diverged loss) by None so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fmt(value, spec, unknown="?"):
    if value is None:
        return unknown
    if isinstance(value, str):
        return value
    return format(value, spec)


def _fmt_p(p):
    return "?" if p is None else f"{p:.3g}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines


def render_markdown(result):
    target = result["target"]
    comparisons = {c["candidate"]: c for c in result["comparisons"]}
    out = [f"## Summary (target val loss {target})", ""]
    rows = []
    for g in result["groups"]:
        c = comparisons.get(g["name"])
        if result["baseline"] == g["name"]:
            time_delta = loss_delta = "baseline"
        elif c is None:
            time_delta = loss_delta = "-"
        else:
            time_delta = (f"{_fmt(c['time_delta_s'], '+.3f')} s ({_fmt(c['time_delta_pct'], '+.2f')}%)"
                          if c["time_delta_s"] is not None else "?")
            loss_delta = _fmt(c["loss_delta"], "+.4f")
        steps = ",".join(str(s) for s in g["total_steps"]) or "?"
        rows.append([g["name"], g["n"], steps, _fmt(g["time_mean_s"], ".3f"), _fmt(g["time_std_s"], ".3f"),
                     time_delta, _fmt(g["loss_mean"], ".4f"), _fmt(g["loss_std"], ".4f"), loss_delta,
                     _fmt_p(g["p_below_target"])])
    out += _table(["Group", "Runs", "Steps", "Time-mean", "Time-std", "Time-delta", "Loss-mean", "Loss-std",
                   "Loss-delta", "p"], rows)
    out += ["", f"Times in seconds: {result['time_convention']}. Deltas are candidate - baseline. "
            f"p: one-sided one-sample t-test that the mean final val loss is below {target} "
            f"(record rule: p < {P_THRESHOLD} over >= {MIN_RUNS} runs).", ""]

    out += ["## Groups", ""]
    rows = []
    for g in result["groups"]:
        rows.append([g["name"], g["n"], g["n_excluded"], _fmt(g["loss_mean"], ".4f"), _fmt(g["loss_std"], ".4f"),
                     _fmt_p(g["p_below_target"]), _fmt(g["runs_needed"], "d"), _fmt(g["time_mean_s"], ".3f"),
                     _fmt(g["time_std_s"], ".3f"), _fmt(g["time_median_s"], ".3f"), _fmt(g["time_min_s"], ".3f"),
                     _fmt(g["time_max_s"], ".3f")])
    out += _table(["Group", "n", "Excluded", "Loss-mean", "Loss-std", "p", "Runs-needed", "Time-mean",
                   "Time-std", "Time-median", "Time-min", "Time-max"], rows)
    out += ["", f"Runs-needed: {result['runs_needed_method']}.", ""]

    if result["comparisons"]:
        out += [f"## Candidates vs baseline {result['baseline']}", ""]
        rows = [[c["candidate"], _fmt(c["time_delta_s"], "+.3f"), _fmt(c["time_delta_pct"], "+.2f"),
                 _fmt(c["speedup"], ".4f"), _fmt_p(c["p_time_two_sided"]), _fmt_p(c["p_time_candidate_faster"]),
                 _fmt(c["loss_delta"], "+.4f"), _fmt_p(c["p_loss_two_sided"])] for c in result["comparisons"]]
        out += _table(["Candidate", "Time-delta (s)", "Time-delta (%)", "Speedup", "p time (Welch, two-sided)",
                       "p faster (Welch, one-sided)", "Loss-delta", "p loss (Welch, two-sided)"], rows)
        out += ["", "Speedup = baseline mean time / candidate mean time.", ""]

    if "at_step" in result:
        out += ["## Val loss at equal steps", ""]
        rows = []
        for a in result["at_step"]:
            if result["baseline"] == a["group"]:
                delta = p = "baseline"
            elif result["baseline"] is None:
                delta = p = "-"
            else:
                delta, p = _fmt(a["loss_delta"], "+.4f"), _fmt_p(a["p_loss_two_sided"])
            rows.append([a["group"], a["step"], a["n"], a["n_lacking"], _fmt(a["loss_mean"], ".4f"),
                         _fmt(a["loss_std"], ".4f"), _fmt(a["loss_min"], ".4f"), _fmt(a["loss_max"], ".4f"),
                         delta, p])
        out += _table(["Group", "Step", "n", "Lacking", "Loss-mean", "Loss-std", "Loss-min", "Loss-max",
                       "Loss-delta", "p loss (Welch, two-sided)"], rows)
        out += ["", "n: runs with a val loss at that step, finished or not; Lacking: runs of the group without "
                "one (not counted). Loss-delta: candidate mean - baseline mean at the same step.", ""]

    out += ["## Runs", ""]
    rows = []
    for g in result["groups"]:
        for r in g["runs"]:
            step = f"{_fmt(r['last_step'], 'd')}/{_fmt(r['total_steps'], 'd')}"
            rows.append([g["name"], r["name"], _fmt(r["source_hash"], "s"), _fmt(r["hardware"], "s"),
                         _fmt(r["torch"], "s"), _fmt(r["triton"], "s"), _fmt(r["cuda"], "s"), step,
                         _fmt(r["val_loss"], ".4f"), _fmt(r["train_time_s"], ".3f"), _fmt(r["step_avg_ms"], ".2f"),
                         _fmt(r["peak_mem_allocated_mib"], "d"), _fmt(r["hellaswag_acc_norm"], ".4f", "-"),
                         "finished" if r["usable"] else "excluded"])
    out += _table(["Group", "File", "Source", "GPU", "torch", "triton", "CUDA", "Step", "Val-loss", "Time",
                   "Step-avg-ms", "Peak-MiB", "HellaSwag", "Status"], rows)
    out.append("")
    if result["warnings"]:
        out += ["## Warnings", ""] + [f"- {w}" for w in result["warnings"]] + [""]
    if result["skipped"]:
        out += ["## Skipped files", ""] + [f"- {s['path']}: {s['reason']}" for s in result["skipped"]] + [""]
    return "\n".join(out)


def plot_curves(groups, target, path):
    """Validation loss vs training time and vs step for every run, one colour per group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    losses = []
    for i, (name, runs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        for j, run in enumerate(runs):
            points = [(s, t, v) for s, t, v in run.val_curve if t is not None and v is not None]
            if not points:
                continue
            steps, times, vals = zip(*points)
            label = name if j == 0 else None
            ax_time.plot([t / 1000.0 for t in times], vals, color=colour, alpha=0.7, label=label, marker=".")
            ax_step.plot(steps, vals, color=colour, alpha=0.7, label=label, marker=".")
            losses.extend(vals)
    for ax, xlabel in ((ax_time, "training time (s)"), (ax_step, "step")):
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        if losses:
            # The first evaluation (~10.8 at step 0) would flatten the interesting region near the target.
            top = min(max(losses), target + 1.0)
            bottom = min(min(losses), target) - 0.02
            ax.set_ylim(bottom, max(top, bottom + 0.1))
    ax_step.legend()
    fig.suptitle(f"validation loss (dashed: target {target})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Command line


def build_parser():
    parser = argparse.ArgumentParser(description="Compare speedrun records (see the module docstring).")
    parser.add_argument("paths", nargs="*", help="log files or folders of *.txt/*.log logs (one group per folder)")
    parser.add_argument("--group", action="append", default=[], metavar="NAME=PATH[,PATH...]",
                        help="explicit group (repeatable)")
    parser.add_argument("--baseline", help="group every other group is compared against")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target val loss (default 3.28)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--plot", metavar="FILE.png", help="write validation-loss curves to this PNG")
    parser.add_argument("--at-step", type=_steps_arg, metavar="STEPS",
                        help="also compare the val loss at these steps (comma-separated), over every run that "
                             "logged one, finished or not")
    return parser


def _steps_arg(text):
    """``--at-step`` value: comma-separated integers >= 0, in order, each once."""
    items = [item.strip() for item in text.split(",")]
    if not all(re.fullmatch(r"[0-9]+", item) for item in items):
        raise argparse.ArgumentTypeError(f"expects comma-separated integers >= 0 (e.g. 250,500), got {text!r}")
    return list(dict.fromkeys(int(item) for item in items))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.paths and not args.group:
        parser.print_usage(sys.stderr)
        print("error: give at least one PATH or --group", file=sys.stderr)
        return 2
    try:
        files_by_group = collect_groups(args.paths, args.group)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.baseline is not None and args.baseline not in files_by_group:
        print(f"error: --baseline {args.baseline!r} is not a group; groups: {', '.join(files_by_group)}",
              file=sys.stderr)
        return 2
    groups, skipped = {}, []
    for name, files in files_by_group.items():
        groups[name] = []
        for path in files:
            try:
                run = parse_log(path)
            except LogError as exc:
                skipped.append((str(path), str(exc)))
                print(f"skipped {path}: {exc}", file=sys.stderr)
                continue
            run.group = name
            groups[name].append(run)
    result = analyze(groups, skipped, args.target, args.baseline, args.at_step)
    print(json.dumps(json_safe(result), indent=1, allow_nan=False) if args.json else render_markdown(result))
    if args.plot:
        try:
            plot_curves(groups, args.target, args.plot)
        except OSError as exc:
            print(f"error: cannot write plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    n_usable = sum(g["n"] for g in result["groups"]) + sum(a["n"] for a in result.get("at_step", []))
    if n_usable == 0:
        print("error: no usable run (finished, with a final val loss)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
