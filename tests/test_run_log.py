"""Tests of run_log.py: the code a log copies (every imported repository module but tests and benchmarks, the
modules beside train_gpt.py included), the header and the footer. A smoke run's log: test_train_gpt.py; a log
never overwritten and the run id's checks: test_reliability.py."""
import os
import sys
from pathlib import Path

import torch

import run_log
import train_gpt as tg  # noqa: F401  (imports what a training run imports)

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
    assert {"compilation.py", "evaluation.py", "flags.py", "profiling.py", "run_log.py"} <= set(expected)
    dump = run_log.source_dump()
    assert dump.startswith("# ===== file: compilation.py =====\n") and "# ===== file: train_gpt.py =====" in dump


def test_header_names_versions_corpus_and_hyperparameters(tmp_path):
    val = tmp_path / "v.bin"
    val.write_bytes(b"x" * 100)
    lines = run_log.header_lines(tg.smoke_hyperparameters(), tg.Dist(), [tmp_path / "t.bin"], [val])
    keys = [line.split(": ", 1)[0] for line in lines[:9]]
    assert keys == ["git_sha", "python", "torch", "triton", "cuda", "gpu", "world_size", "corpus", "hyperparameters"]
    assert lines[5] == "gpu: cpu x 1" or torch.cuda.is_available()


def test_footer_tokens_per_second_and_stage_means():
    lines = []
    run_log.log_summary(lines.append, tg.Dist(world=2), tokens=4000, train_ms=2000.0,
                        stage_ms={1: [30.0, 50.0], 0: [10.0]}, matmul_weights=10**8)
    assert lines[0] == "tokens_per_s_per_gpu: 1000"  # 4000 tokens over 2 s on 2 ranks
    assert lines[1] == "mfu: n/a (no peak FLOP/s figure for this device)"  # a CPU Dist
    assert lines[-1] == "stage_step_avg: stage0:10.00ms stage1:40.00ms"
    lines.clear()
    run_log.log_summary(lines.append, tg.Dist(), tokens=0, train_ms=0.0, stage_ms={}, matmul_weights=1)
    assert lines[0] == "tokens_per_s_per_gpu: 0", "a resumed run with no step left"
