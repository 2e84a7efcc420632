"""One benchmark for every kernel family: ``python -m benchmarks [--only NAME ...] [--csv PATH]``.

The driver is this package's ``__main__``: it sits beside the cases it runs and imports only downwards
(``benchmarks`` -> ``kernels``). Each module of the package (``benchmarks/<family>.py``, found by listing the
package, so a new family needs no change here) exposes ``bench_cases(device, tune=False)``, returning a list
of dicts:

    op        str       kernel name as the module exports it, e.g. "transpose_copy"
    shape     str       human-readable shape, e.g. "768x50304"
    dtype     str       e.g. "bf16"
    fn        callable  no arguments; runs our kernel once on preallocated inputs
    bytes     int       minimum DRAM traffic: each input read once + each output written once
    flops     int       useful floating-point operations (0 for pure data movement)
    baselines dict      name -> callable with no arguments ("torch", "torch.compile", ...)
    check     callable  optional, no arguments; raises if ``fn``'s result is wrong (run once, untimed)

``bench_cases(device, tune=True)`` (``--tune``) adds one case per entry of the kernel module's ``TUNING_CANDIDATES``
(op names like ``xxt[128x128x64w8s3]``): the only place launch configurations are searched; the winners are
then hard-coded in the modules with the GPU they were chosen on.

The harness times every callable with ``triton.testing.do_bench`` (CUDA events, median of back-to-back calls:
what a caller sees, Python launch overhead included when it exceeds the GPU time) and our kernel also with
``do_bench_cudagraph`` (median of graph replays: GPU time alone, the "graph" column), computes achieved
GB/s and TFLOP/s, the roofline time ``max(bytes / BW, flops / PEAK)`` and the percent of it reached, the
speedup over each baseline, prints one table and writes a CSV with the GPU name, versions and git sha.

Ceilings: ``kernels.hardware.CEILINGS`` (measured device-to-device copy and dense bf16 matmul, the table
the trainer's MFU line uses too). Other GPUs fall back to the H100 numbers with a warning.
"""
import argparse
import csv
import importlib
import platform
import sys
import time

from benchmarks import families
from kernels.hardware import CEILINGS, ceilings_for, git_sha


def gpu_ceilings(gpu_name):
    ceilings = ceilings_for(gpu_name)
    if ceilings is None:
        print(f"warning: no measured ceilings for {gpu_name!r}; using the H100 figures", file=sys.stderr)
        ceilings = CEILINGS["H100"]
    return ceilings


def time_us(fn, warmup_ms, rep_ms):
    """Median over back-to-back calls (CUDA events): includes Python launch overhead when that is slower."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def time_graph_us(fn, rep_ms):
    """Median of CUDA-graph replays of ``fn``: the GPU time alone, without Python launch overhead."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    except Exception as e:  # e.g. a host sync inside fn; reported, not fatal
        print(f"  cuda-graph timing failed: {type(e).__name__}: {e}", file=sys.stderr)
        return float("nan")


def fmt_rate(case, us):
    if case["flops"]:
        return f"{case['flops'] / us / 1e6:.1f} TFLOP/s"
    return f"{case['bytes'] / us / 1e3:.0f} GB/s"


def run(modules, csv_path, warmup_ms, rep_ms, tune=False):
    import torch
    import triton
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks needs a CUDA GPU: timings under the Triton interpreter mean nothing.")
    gpu = torch.cuda.get_device_name()
    bw, peak = gpu_ceilings(gpu)
    rows = []
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__} | CUDA {torch.version.cuda} | "
          f"git {git_sha()} | ceilings {bw / 1e12:.1f} TB/s, {peak / 1e12:.0f} TFLOP/s", flush=True)
    for name in modules:
        mod = importlib.import_module(f"benchmarks.{name}")
        for case in mod.bench_cases("cuda", tune=tune):
            if case.get("check") is not None:
                case["check"]()
            us = time_us(case["fn"], warmup_ms, rep_ms)
            graph_us = time_graph_us(case["fn"], rep_ms)
            roof_us = max(case["bytes"] / bw, case["flops"] / peak) * 1e6
            row = dict(module=name, op=case["op"], shape=case["shape"], dtype=case["dtype"], us=us,
                       graph_us=graph_us,
                       rate=fmt_rate(case, us), roofline_us=roof_us, pct_roofline=100 * roof_us / us,
                       bytes=case["bytes"], flops=case["flops"])
            for bname, bfn in case.get("baselines", {}).items():
                try:
                    b_us = time_us(bfn, warmup_ms, rep_ms)
                except Exception as e:  # a baseline that cannot run is reported, not fatal
                    print(f"  baseline {bname} for {case['op']} {case['shape']} failed: {type(e).__name__}: {e}",
                          file=sys.stderr)
                    b_us = float("nan")
                row[f"{bname}_us"] = b_us
                row[f"speedup_vs_{bname}"] = b_us / us
            rows.append(row)
            base = "  ".join(f"{k[:-3]} {v:8.1f} us ({row['speedup_vs_' + k[:-3]]:.2f}x)"
                             for k, v in row.items() if k.endswith("_us") and k not in ("us", "roofline_us", "graph_us"))
            print(f"{row['op']:>22} | {row['shape']:>16} | {row['dtype']:>5} | {us:8.1f} us (graph {graph_us:7.1f}) | "
                  f"{row['rate']:>15} | "
                  f"{row['pct_roofline']:5.1f}% of {roof_us:7.1f} us | {base}", flush=True)
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), git_sha=git_sha(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if csv_path:
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in rows[0], k)) if rows else []
        with open(csv_path, "w", newline="") as f:
            f.write("# " + " ".join(f"{k}={v}" for k, v in meta.items()) + "\n")
            w = csv.DictWriter(f, fieldnames=list(meta) + keys)
            w.writeheader()
            for r in rows:
                w.writerow({**meta, **r})
        print(f"wrote {csv_path} ({len(rows)} rows)")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    names = families()
    ap.add_argument("--only", nargs="*", choices=names, help="kernel families to run (default: all)")
    ap.add_argument("--csv", default="kernels_bench.csv", help="CSV output path ('' to skip)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=200)
    ap.add_argument("--tune", action="store_true",
                    help="also time every launch configuration in each kernel module's TUNING_CANDIDATES")
    a = ap.parse_args(argv)
    run(a.only or names, a.csv, a.warmup_ms, a.rep_ms, tune=a.tune)


if __name__ == "__main__":
    main()
