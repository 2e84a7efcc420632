"""Train at several world sizes on one machine and compare their speed side by side.

Usage:
    python records/world_sizes.py [--nproc 1,2,4,8] [--out logs/world_sizes] [--run-id PREFIX]
        [--profile-steps 3] [--json] [-- TRAINER FLAGS ...]
    python records/world_sizes.py --logs LOG [LOG ...] [--json]      (compare logs that already exist)

For each world size W in turn it runs ``torchrun --standalone --nproc_per_node=W train_gpt.py --run-id
PREFIX_wsW --log-dir OUT --checkpoint-dir OUT/ckpt --profile-steps N TRAINER FLAGS`` (its output goes to
OUT/PREFIX_wsW.out), then reads the logs with records/compare.py's parser and prints one Markdown table, a
column per world size. Default world sizes: 1, 2, 4 and 8 as far as the machine has GPUs; without a GPU, 1 and
2 (gloo on the CPU, where the trainer needs ``--smoke``: the tests run it so). Every world size computes the
same steps (the global batch is fixed), so the columns compare the cost of the same work.

Rows (``?``: not in the log; a run that failed is marked in its column's header):

* ``log``, ``hardware`` (the log's GPU and count), ``final val loss``, ``train time s`` (final validation line);
* ``tokens/s per GPU`` (the log's ``tokens_per_s_per_gpu``) and ``per GPU vs world size 1`` (its ratio to the
  first column's: 1.00 is perfect scaling);
* ``stageI ms/step``: the mean step time of stage I (``stage_step_avg``);
* with ``--profile-steps`` N > 0, per profiled stage I, from the table of ``--profile-steps`` (rank 0, N untimed
  steps at the stage's start), per step: ``stageI profiled ms/step`` (wall), ``stageI comm ms/step`` (time
  some communication kernel runs), ``stageI comm overlapped`` (the share of it during which another kernel
  runs too: hidden behind compute; ``?`` without collectives) and ``stageI comm exposed ms/step`` (only
  collectives running).

It lives in records/ beside compare.py, whose parser it uses, and writes run logs like the records'
(benchmarks/ holds kernel cases: ``python -m benchmarks`` takes every module there for a kernel family).

``--json`` prints the same as a list of objects, one per world size. Exit status: 0 when every run finished and
every log parsed, 1 otherwise, 2 for usage errors (a world size that is not 1, 2, 4 or 8, or more GPUs than
the machine has).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare.py, the one parser of the trainer's logs
from compare import LogError, parse_log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZES = (1, 2, 4, 8)


def default_world_sizes():
    """1, 2, 4 and 8 as far as there are GPUs; 1 and 2 without (gloo on the CPU)."""
    import torch
    n = torch.cuda.device_count()
    return [w for w in WORLD_SIZES if w <= n] if n else [1, 2]


def run_world_size(world, out, run_id, profile_steps, trainer_flags):
    """Train at one world size; returns (log path, exit code). The run's output goes to OUT/<run_id>.out."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(REPO / "train_gpt.py"), "--run-id", run_id, "--log-dir", str(out),
           "--checkpoint-dir", str(out / "ckpt"), "--profile-steps", str(profile_steps), *trainer_flags]
    console = out / f"{run_id}.out"
    print(f"world size {world}: {' '.join(cmd)}  (output: {console})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(console, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"world size {world}: exit code {code} after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out / f"{run_id}.txt", code


def summary(path, code=0):
    """One column's numbers: {"world_size", "log", "exit_code", "problem", and the figures of the table}."""
    row = {"world_size": None, "log": str(path), "exit_code": code, "problem": None}
    try:
        run = parse_log(path)
    except LogError as e:
        row["problem"] = str(e)
        return row
    row.update(world_size=run.world_size, hardware=run.hardware, val_loss=run.val_loss,
               train_time_s=run.train_time_s, tokens_per_s_per_gpu=run.tokens_per_s_per_gpu,
               stage_ms=dict(run.stage_step_avg_ms), profile={})
    for stage, p in run.profile.items():
        n, comm = p.get("steps") or None, p.get("communication", {})
        per_step = {"wall_ms": p.get("wall_ms"), "comm_ms": comm.get("busy_ms"),
                    "comm_exposed_ms": comm.get("exposed_ms")}
        row["profile"][stage] = {k: None if v is None or n is None else v / n for k, v in per_step.items()}
        busy, hidden = comm.get("busy_ms"), comm.get("overlapped_ms")
        row["profile"][stage]["comm_overlapped"] = hidden / busy if busy and hidden is not None else None
    if code == 0 and not run.usable:
        row["problem"] = "; ".join(run.problems) or "unusable"
    return row


def _fmt(value, spec):
    return "?" if value is None else format(value, spec)


def _pct(share):
    return "?" if share is None else f"{100 * share:.1f}%"


def table(rows):
    """The Markdown table: a column per world size, the rows of the module docstring."""
    def header(r):
        name = f"world size {_fmt(r['world_size'], 'd')}"
        if r["exit_code"] == 0 and not r["problem"]:
            return name
        return f"{name} (failed: exit code {r['exit_code']}" + (f", {r['problem']})" if r["problem"] else ")")

    base = rows[0].get("tokens_per_s_per_gpu")
    lines = [("log", [r["log"] for r in rows]),
             ("hardware", [r.get("hardware") or "?" for r in rows]),
             ("final val loss", [_fmt(r.get("val_loss"), ".4f") for r in rows]),
             ("train time s", [_fmt(r.get("train_time_s"), ".1f") for r in rows]),
             ("tokens/s per GPU", [_fmt(r.get("tokens_per_s_per_gpu"), ".0f") for r in rows]),
             ("per GPU vs world size 1", [_fmt(r["tokens_per_s_per_gpu"] / base if base and r.get(
                 "tokens_per_s_per_gpu") is not None else None, ".2f") for r in rows])]
    for s in sorted({s for r in rows for s in r.get("stage_ms", {})}):
        lines.append((f"stage{s} ms/step", [_fmt(r.get("stage_ms", {}).get(s), ".2f") for r in rows]))
    for s in sorted({s for r in rows for s in r.get("profile", {})}):
        prof = [r.get("profile", {}).get(s, {}) for r in rows]
        lines += [(f"stage{s} profiled ms/step", [_fmt(p.get("wall_ms"), ".2f") for p in prof]),
                  (f"stage{s} comm ms/step", [_fmt(p.get("comm_ms"), ".2f") for p in prof]),
                  (f"stage{s} comm overlapped", [_pct(p.get("comm_overlapped")) for p in prof]),
                  (f"stage{s} comm exposed ms/step", [_fmt(p.get("comm_exposed_ms"), ".2f") for p in prof])]
    out = ["| | " + " | ".join(header(r) for r in rows) + " |", "| --- |" + " --- |" * len(rows)]
    out += [f"| {name} | " + " | ".join(values) + " |" for name, values in lines]
    return "\n".join(out)


def parse_world_sizes(text):
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of world sizes, got {text!r}") from None
    bad = [w for w in sizes if w not in WORLD_SIZES]
    if bad or not sizes:
        raise argparse.ArgumentTypeError(f"world sizes must be among {WORLD_SIZES}, got {text!r}")
    return sizes


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, trainer_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python records/world_sizes.py", description=__doc__.splitlines()[0],
                                epilog="Flags after -- go to train_gpt.py.")
    p.add_argument("--nproc", type=parse_world_sizes, help="world sizes, e.g. 1,2,4,8 (default: as many GPUs "
                                                           "as there are; 1,2 without a GPU)")
    p.add_argument("--out", default="logs/world_sizes", help="folder of the logs and the runs' output")
    p.add_argument("--run-id", default=None, help="prefix of the run ids (default: ws_<date>_<time>)")
    p.add_argument("--profile-steps", type=int, default=3, help="train_gpt.py --profile-steps (0: no profile)")
    p.add_argument("--logs", nargs="+", metavar="LOG", help="compare these logs instead of training")
    p.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    a = p.parse_args(ours)
    if a.logs:
        rows = [summary(Path(path)) for path in a.logs]
    else:
        sizes = a.nproc or default_world_sizes()
        import torch
        if torch.cuda.is_available() and max(sizes) > torch.cuda.device_count():
            p.error(f"world size {max(sizes)} needs {max(sizes)} GPUs, this machine has {torch.cuda.device_count()}")
        out = Path(a.out).resolve()  # the runs start in the repository
        out.mkdir(parents=True, exist_ok=True)
        prefix = a.run_id or time.strftime("ws_%Y%m%d_%H%M%S")
        rows = [summary(*run_world_size(w, out, f"{prefix}_ws{w}", a.profile_steps, trainer_flags)) for w in sizes]
    print(json.dumps(rows, indent=1) if a.json else table(rows))
    return 0 if all(r["exit_code"] == 0 and not r["problem"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
