"""Tests of records/compare.py: log parsing (public and our format), statistics, warnings, outputs, CLI.

Synthetic logs are written in tmp_path by ``write_log`` in this project's format; the public format is checked
on ``tests/fixtures/modded_nanogpt_011625_Sub3Min_excerpt.txt`` (an excerpt of a real public log, see
``tests/fixtures/README.md`` for its provenance and the numbers expected here).
"""
import hashlib
import importlib.util
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "modded_nanogpt_011625_Sub3Min_excerpt.txt"

# records/ is a folder of records, not a package: load the tool by path.
_spec = importlib.util.spec_from_file_location("records_compare", ROOT / "records" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

SEP = "=" * 100
SUMMARY_COLUMNS = ["Group", "Runs", "Steps", "Time-mean", "Time-std", "Time-delta", "Loss-mean", "Loss-std",
                   "Loss-delta", "p"]


def write_log(path, final_loss, final_time_ms, *, total=100, gpu="NVIDIA H200 x 1", torch_version="2.11.0+cu128",
              source="print('train')\n", mid_loss=None, validate=True, finish=True, cut_final=False,
              corpus="fineweb10B", seed=0, lr=0.02):
    """Write a log in train_gpt.py's format: validation at steps 0, total/2 and total (when finished).

    ``mid_loss`` defaults to ``final_loss + 0.5`` so runs with different final losses have different loss
    sequences; ``cut_final`` ends the file in the middle of the final validation line.
    """
    mid = total // 2
    mid_loss = final_loss + 0.5 if mid_loss is None else mid_loss
    lines = ["# ===== file: train_gpt.py =====", *source.splitlines(), SEP,
             "git_sha: 0123456789abcdef", "python: 3.12.3 (main, Apr 10 2025)", f"torch: {torch_version}",
             "triton: 3.6.0", "cuda: 12.8", f"gpu: {gpu}", "world_size: 1", f"corpus: {corpus}",
             'hyperparameters: {"num_iterations": %d, "seed": %d, "lr": %s}' % (total, seed, lr),
             f"Running PyTorch {torch_version} compiled for CUDA 12.8",
             "|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |",
             SEP]
    step_ms = final_time_ms / total
    for step in range(total + 1):
        t = round(step * step_ms)
        avg = f"{t / step:.2f}" if step else "nan"
        if validate and step in (0, mid) and step < total:
            loss = 10.8258 if step == 0 else mid_loss
            lines.append(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{t}ms step_avg:{avg}ms")
        if step == total and not finish:
            break
        if step > 0:
            lines.append(f"step:{step}/{total} train_time:{t}ms step_avg:{avg}ms")
    if finish and validate:
        final = f"step:{total}/{total} val_loss:{final_loss:.4f} train_time:{final_time_ms}ms " \
                f"step_avg:{final_time_ms / total:.2f}ms"
        if cut_final:
            Path(path).write_text("\n".join(lines) + "\n" + final[: len(final) // 2])
            return path
        lines.append(final)
    if finish:
        lines += ["peak memory allocated: 21000 MiB reserved: 22500 MiB", "tokens_per_s_per_gpu: 812345",
                  "mfu: 41.5%", "compile_warmup_s: 73.2"]
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def run_main(argv, capsys):
    rc = compare.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def parse_markdown_table(text, first_column):
    """Rows (as dicts) of the Markdown table whose header starts with ``| first_column |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return header, rows


# ----------------------------------------------------------------------------------------------------------
# Parsing


def test_public_fixture_parsed():
    run = compare.parse_log(FIXTURE)
    text = FIXTURE.read_text()
    source = text[: text.index(SEP)]
    assert run.source_hash == hashlib.sha256(source.encode()).hexdigest()[:10]
    assert run.python == "3.12.7"
    assert run.torch == "2.7.0.dev20250110+cu126"
    assert run.cuda == "12.6"
    assert run.triton is None
    assert (run.gpu_model, run.gpu_count) == ("NVIDIA H100 80GB HBM3", 8)
    assert (run.total_steps, run.last_step, run.finished, run.usable) == (1385, 1385, True, True)
    assert run.val_loss == 3.2792
    assert run.train_time_s == pytest.approx(178.752, abs=1e-12)
    assert run.step_avg_ms == 130.00
    assert (run.peak_mem_allocated_mib, run.peak_mem_reserved_mib) == (37653, 39236)
    assert run.val_curve == [(0, 0.0, 10.8258), (125, 14290.0, 4.3930), (1375, 177379.0, 3.2811),
                             (1385, 178752.0, 3.2792)]
    assert run.problems == []


def test_our_format_parsed(tmp_path):
    run = compare.parse_log(write_log(tmp_path / "a.txt", 3.2765, 61234, total=40))
    assert (run.git_sha, run.python, run.torch, run.triton, run.cuda) == \
        ("0123456789abcdef", "3.12.3", "2.11.0+cu128", "3.6.0", "12.8")
    # The "gpu:" line (what training used) wins over the nvidia-smi table (what the machine has).
    assert (run.gpu_model, run.gpu_count, run.world_size) == ("NVIDIA H200", 1, 1)
    assert run.corpus == "fineweb10B"
    assert run.hyperparameters == {"num_iterations": 40, "seed": 0, "lr": 0.02}
    assert (run.total_steps, run.val_loss, run.train_time_s, run.step_avg_ms) == (40, 3.2765, 61.234, 1530.85)
    assert (run.tokens_per_s_per_gpu, run.mfu_pct, run.compile_warmup_s) == (812345.0, 41.5, 73.2)
    assert [v for _, _, v in run.val_curve] == [10.8258, 3.7765, 3.2765]


def test_old_public_format_with_train_loss():
    text = "\n".join(["import os", SEP, "Running PyTorch 2.5.0 compiled for CUDA 12.4", SEP,
                      "step:0/4 val_loss:10.8258 train_time:0ms step_avg:nanms",
                      "step:1/4 train_loss:10.8258 train_time:30ms step_avg:nanms",
                      "step:2/4 train_loss:9.5 train_time:60ms step_avg:30.00ms",
                      "step:3/4 train_loss:8.25 train_time:90ms step_avg:30.00ms",
                      "step:4/4 train_loss:7.0 train_time:120ms step_avg:30.00ms",
                      "step:4/4 val_loss:7.1234 train_time:121ms step_avg:30.25ms", ""])
    run = compare.parse_log_text(text, "old.txt")
    assert run.train_losses == [(1, 10.8258), (2, 9.5), (3, 8.25), (4, 7.0)]
    assert (run.val_loss, run.train_time_s, run.step_avg_ms, run.finished) == (7.1234, 0.121, 30.25, True)
    assert (run.torch, run.cuda, run.gpu_model) == ("2.5.0", "12.4", None)


@pytest.mark.parametrize("line, expected", [
    ("step:3/10 train_time:90ms step_avg:30.00ms", {"train_time": "90", "step_avg": "30.00"}),
    ("step:3/10 train_time:90ms step_avg:30.00ms train_loss:4.125000",  # train_gpt.py --train-loss
     {"train_time": "90", "step_avg": "30.00", "train_loss": "4.125000"}),
    ("step:3/10 train_loss:4.125 train_time:90ms step_avg:30.00ms",  # older public logs
     {"train_time": "90", "step_avg": "30.00", "train_loss": "4.125"}),
    ("step:0/10 val_loss:10.8258 train_time:0ms step_avg:nanms", {"val_loss": "10.8258", "train_time": "0",
                                                                  "step_avg": "nan"}),
    ("step:10/10 step_avg:3.5ms val_loss:3.2775 train_time:35ms  ", {"val_loss": "3.2775", "train_time": "35",
                                                                     "step_avg": "3.5"}),
])
def test_step_line_fields_in_any_order(line, expected):
    step = int(line.split("/")[0].split(":")[1])
    assert compare.parse_step_line(line) == {"step": step, "total": 10, **expected}


@pytest.mark.parametrize("line", [
    "step:3/10 train_time:90ms step_avg:30.0",           # cut before the unit
    "step:3/10 train_time:90ms step_a",                   # cut inside a key
    "step:3/10 train_time:90ms",                          # step_avg missing
    "step:3/10 train_time:90ms step_avg:30.00ms train_loss:4.1 train_loss:4.2",  # repeated key
    "step:3/10 train_time:90ms step_avg:30.00ms lr:0.1",  # unknown key
    "step:3/10 train_time:90s step_avg:30.00ms",          # wrong unit
    "step:3/10 hellaswag_acc_norm:0.3 train_time:90ms",   # an evaluation field inside a timed line
    "step:3/10 hellaswag_acc_norm:0.3 step_avg:30.00ms train_time:90ms",
    "step:3/10 hellaswag_acc_norm:0.3 hellaswag_acc_norm:0.4",
    "step:3/10 hellaswag_acc_norm:high",
    "step:3/10 val_loss:abc train_time:90ms step_avg:30.00ms",
    "step:3 train_time:90ms step_avg:30.00ms",
    "step:",
])
def test_incomplete_step_lines_are_rejected(line):
    assert compare.parse_step_line(line) is None


def test_evaluation_lines_are_parsed_apart_from_step_lines(tmp_path):
    """train_gpt.py --hellaswag-every writes `step:S/T hellaswag_acc_norm:Y` (no times: the clock is stopped):
    neither a cut-short step line nor a step of the curve; the value at the final step is the run's."""
    assert compare.parse_step_line("step:4/10 hellaswag_acc_norm:0.2950") == \
        {"step": 4, "total": 10, "hellaswag_acc_norm": "0.2950"}
    text = (SEP + "\n" + "\n".join([
        "step:0/4 val_loss:10.8258 train_time:0ms step_avg:nanms", "step:0/4 hellaswag_acc_norm:0.2500",
        "step:1/4 train_time:30ms step_avg:30.00ms", "step:2/4 train_time:60ms step_avg:30.00ms",
        "step:3/4 train_time:90ms step_avg:30.00ms", "step:4/4 train_time:120ms step_avg:30.00ms",
        "step:4/4 val_loss:7.1234 train_time:121ms step_avg:30.25ms", "step:4/4 hellaswag_acc_norm:0.3125", ""]))
    run = compare.parse_log_text(text, "eval.txt")
    assert not any("cut short" in p for p in run.problems)
    assert run.hellaswag_curve == [(0, 0.25), (4, 0.3125)]
    assert (run.hellaswag_acc_norm, run.val_loss, run.last_step, run.finished) == (0.3125, 7.1234, 4, True)
    assert [s for s, _, _ in run.val_curve] == [0, 4]
    run.group = "g"
    out = compare.render_markdown(compare.analyze({"g": [run]}, [], 5.0))
    header = next(line for line in out.splitlines() if line.startswith("| Group | File"))
    row = next(line for line in out.splitlines() if "| eval.txt |" in line)
    assert row.split("|")[header.split("|").index(" HellaSwag ")].strip() == "0.3125"


def test_log_with_train_loss_last_parses(tmp_path):
    """The order train_gpt.py --train-loss writes: every step line is complete, the losses are kept."""
    text = (SEP + "\n" + "\n".join(["step:0/2 val_loss:10.8258 train_time:0ms step_avg:nanms",
                                     "step:1/2 train_time:30ms step_avg:30.00ms train_loss:10.500000",
                                     "step:2/2 train_time:60ms step_avg:30.00ms train_loss:9.250000",
                                     "step:2/2 val_loss:9.1234 train_time:61ms step_avg:30.50ms"]) + "\n")
    run = compare.parse_log_text(text, "ours.txt")
    assert not any("cut short" in p for p in run.problems), run.problems
    assert run.train_losses == [(1, 10.5), (2, 9.25)]
    assert (run.val_loss, run.finished) == (9.1234, True)


def test_truncated_log_is_unfinished(tmp_path):
    run = compare.parse_log(write_log(tmp_path / "cut.txt", 3.27, 60000, cut_final=True))
    assert not run.finished and not run.usable
    assert run.val_loss is None and run.train_time_s is None
    assert run.last_step == 100
    assert any("cut short" in p for p in run.problems)
    assert any("unfinished" in p for p in run.problems)


def test_unfinished_and_no_validation(tmp_path):
    unfinished = compare.parse_log(write_log(tmp_path / "u.txt", 3.27, 60000, finish=False))
    assert not unfinished.usable and unfinished.last_step == 99 and len(unfinished.val_curve) == 2
    no_val = compare.parse_log(write_log(tmp_path / "n.txt", 3.27, 60000, validate=False))
    assert not no_val.usable and no_val.val_curve == []
    assert "no validation line" in no_val.problems


@pytest.mark.parametrize("content, reason", [
    (b"", "empty file"),
    (b"  \n\n", "empty file"),
    (bytes(range(256)) * 4, "binary"),
    (b"\xff\xfe\x80junk", "not UTF-8"),
    (("import os\n" + SEP + "\nRunning PyTorch 2.7 compiled for CUDA 12.6\n").encode(), "no complete step line"),
    (b"step:5/100 train_ti", "no complete step line"),
])
def test_malformed_files_raise_log_error(tmp_path, content, reason):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(compare.LogError, match=reason):
        compare.parse_log(path)


def test_missing_file_raises_log_error(tmp_path):
    with pytest.raises(compare.LogError, match="cannot read"):
        compare.parse_log(tmp_path / "absent.txt")


# ----------------------------------------------------------------------------------------------------------
# Statistics


def _runs_from_losses(tmp_path, name, losses, times_ms):
    folder = tmp_path / name
    folder.mkdir()
    return [compare.parse_log(write_log(folder / f"{i}.txt", loss, t))
            for i, (loss, t) in enumerate(zip(losses, times_ms))]


def test_one_sample_p_hand_computed(tmp_path):
    # mean 3.27, sample std 0.01, n=3: t = -0.01 / (0.01/sqrt(3)) = -sqrt(3); for df=2 the t CDF has the closed
    # form F(t) = 1/2 + t / (2 sqrt(2 + t^2)), so p = 1/2 - sqrt(3) / (2 sqrt(5)) = 0.112701...
    runs = _runs_from_losses(tmp_path, "g", [3.27, 3.28, 3.26], [60000, 61000, 62000])
    g = compare.group_stats(runs, 3.28)
    assert g["loss_mean"] == pytest.approx(3.27, abs=1e-12)
    assert g["loss_std"] == pytest.approx(0.01, rel=1e-9)
    assert g["p_below_target"] == pytest.approx(0.5 - math.sqrt(3) / (2 * math.sqrt(5)), rel=1e-9)


def test_group_stats_match_scipy(tmp_path):
    losses = [3.2785, 3.2770, 3.2791, 3.2779, 3.2768, 3.2801]
    times = [178752, 179100, 178420, 179900, 178000, 178640]
    g = compare.group_stats(_runs_from_losses(tmp_path, "g", losses, times), 3.28)
    t_s = np.array(times) / 1000.0
    assert g["n"] == 6 and g["n_excluded"] == 0 and g["total_steps"] == [100]
    assert g["loss_mean"] == pytest.approx(np.mean(losses), rel=1e-12)
    assert g["loss_std"] == pytest.approx(np.std(losses, ddof=1), rel=1e-12)
    assert g["p_below_target"] == pytest.approx(
        stats.ttest_1samp(losses, 3.28, alternative="less").pvalue, rel=1e-9)
    assert g["time_mean_s"] == pytest.approx(t_s.mean(), rel=1e-12)
    assert g["time_std_s"] == pytest.approx(t_s.std(ddof=1), rel=1e-12)
    assert (g["time_median_s"], g["time_min_s"], g["time_max_s"]) == \
        pytest.approx((np.median(t_s), 178.0, 179.9), rel=1e-12)


def test_welch_comparison_matches_formula(tmp_path):
    base_l, base_t = [3.2770, 3.2790, 3.2781, 3.2775, 3.2785], [180100, 181300, 179800, 180900, 180500]
    cand_l, cand_t = [3.2779, 3.2786, 3.2768, 3.2790], [176200, 177900, 176800, 177100]
    base = _runs_from_losses(tmp_path, "base", base_l, base_t)
    cand = _runs_from_losses(tmp_path, "cand", cand_l, cand_t)
    c = compare.compare_to_baseline(cand, base)
    bt, ct = np.array(base_t) / 1000, np.array(cand_t) / 1000

    def welch(a, b):
        # Welch's t and Welch-Satterthwaite degrees of freedom, written out independently of scipy's test.
        va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
        t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
        return t, df

    t, df = welch(ct, bt)
    assert c["time_delta_s"] == pytest.approx(ct.mean() - bt.mean(), rel=1e-12)
    assert c["time_delta_pct"] == pytest.approx(100 * (ct.mean() - bt.mean()) / bt.mean(), rel=1e-12)
    assert c["speedup"] == pytest.approx(bt.mean() / ct.mean(), rel=1e-12)
    assert c["p_time_two_sided"] == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9)
    assert c["p_time_candidate_faster"] == pytest.approx(stats.t.cdf(t, df), rel=1e-9)
    t, df = welch(np.array(cand_l), np.array(base_l))
    assert c["loss_delta"] == pytest.approx(np.mean(cand_l) - np.mean(base_l), abs=1e-12)
    assert c["p_loss_two_sided"] == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9)


def test_runs_needed_hand_case():
    # d = (3.28 - 3.275) / 0.005 = 1: need sqrt(n) > t_{0.99, n-1}. From a t table, t_{0.99,7} = 2.998 >
    # sqrt(8) = 2.828 but t_{0.99,8} = 2.896 < sqrt(9) = 3, so n = 9.
    assert compare.runs_needed(3.275, 0.005, 3.28) == 9
    assert compare.runs_needed(3.28, 0.005, 3.28) == "never"
    assert compare.runs_needed(3.29, 0.005, 3.28) == "never"
    assert compare.runs_needed(3.27, 0.0, 3.28) == 2
    assert compare.runs_needed(3.27, None, 3.28) is None


@pytest.mark.parametrize("d", [5.0, 0.7, 0.05, 0.004])
def test_runs_needed_is_smallest(d):
    n = compare.runs_needed(3.28 - d * 0.002, 0.002, 3.28)

    def p(k):
        return stats.t.cdf(-d * math.sqrt(k), k - 1)

    assert p(n) < 0.01
    assert n == 2 or p(n - 1) >= 0.01


# ----------------------------------------------------------------------------------------------------------
# Warnings


def test_identical_runs_warned(tmp_path, capsys):
    folder = tmp_path / "rec"
    folder.mkdir()
    write_log(folder / "a.txt", 3.2771, 60000)
    write_log(folder / "b.txt", 3.2771, 61000)  # same losses, different time: a same-seed repeat
    write_log(folder / "c.txt", 3.2780, 60500)
    rc, out, _ = run_main([folder], capsys)
    assert rc == 0
    warnings = [w for w in out.splitlines() if "identical loss sequences" in w]
    assert len(warnings) == 1 and "a.txt" in warnings[0] and "b.txt" in warnings[0]


def test_mixed_hardware_versions_and_sources_warned(tmp_path, capsys):
    folder = tmp_path / "rec"
    folder.mkdir()
    write_log(folder / "a.txt", 3.2771, 60000)
    write_log(folder / "b.txt", 3.2775, 40000, gpu="NVIDIA H100 80GB HBM3 x 1", torch_version="2.10.0",
              source="print('other')\n")
    rc, out, _ = run_main([folder], capsys)
    assert rc == 0
    assert "mixed hardware: NVIDIA H100 80GB HBM3 x 1, NVIDIA H200 x 1" in out
    assert "mixed torch versions: 2.10.0, 2.11.0+cu128" in out
    assert "mixed source hashes" in out
    assert "only 2 usable run(s), fewer than 5" in out


def test_clean_group_has_no_warnings(tmp_path, capsys):
    folder = tmp_path / "rec"
    folder.mkdir()
    for i, loss in enumerate([3.2771, 3.2775, 3.2779, 3.2768, 3.2782]):
        write_log(folder / f"{i}.txt", loss, 60000 + 100 * i)
    rc, out, _ = run_main([folder], capsys)
    assert rc == 0 and "## Warnings" not in out


def test_baseline_on_other_hardware_warned(tmp_path, capsys):
    for name, gpu in (("base", "NVIDIA H100 80GB HBM3 x 1"), ("cand", "NVIDIA H200 x 1")):
        (tmp_path / name).mkdir()
        write_log(tmp_path / name / "0.txt", 3.2771 if name == "base" else 3.2772, 60000, gpu=gpu)
    rc, out, _ = run_main([tmp_path / "base", tmp_path / "cand", "--baseline", "base"], capsys)
    assert rc == 0 and "cand vs baseline base: hardware differs" in out


# ----------------------------------------------------------------------------------------------------------
# Outputs and command line


@pytest.fixture
def two_groups(tmp_path):
    base_l, base_t = [3.2770, 3.2790, 3.2781, 3.2775, 3.2785], [180100, 181300, 179800, 180900, 180500]
    cand_l, cand_t = [3.2779, 3.2786, 3.2768, 3.2790, 3.2771], [176200, 177900, 176800, 177100, 176500]
    for name, losses, times in (("base", base_l, base_t), ("cand", cand_l, cand_t)):
        (tmp_path / name).mkdir()
        for i, (loss, t) in enumerate(zip(losses, times)):
            write_log(tmp_path / name / f"run{i}.txt", loss, t)
    return tmp_path, (base_l, base_t), (cand_l, cand_t)


def test_markdown_table_parses_back(two_groups, capsys):
    root, (base_l, base_t), (cand_l, cand_t) = two_groups
    rc, out, _ = run_main([root / "cand", root / "base", "--baseline", "base"], capsys)
    assert rc == 0
    header, rows = parse_markdown_table(out, "Group")
    assert header == SUMMARY_COLUMNS
    assert [r["Group"] for r in rows] == ["base", "cand"]  # baseline first
    base, cand = rows
    ct, bt = np.array(cand_t) / 1000, np.array(base_t) / 1000
    assert (cand["Runs"], cand["Steps"]) == ("5", "100")
    assert cand["Time-mean"] == f"{ct.mean():.3f}" and cand["Time-std"] == f"{ct.std(ddof=1):.3f}"
    delta = ct.mean() - bt.mean()
    assert cand["Time-delta"] == f"{delta:+.3f} s ({100 * delta / bt.mean():+.2f}%)"
    assert cand["Loss-mean"] == f"{np.mean(cand_l):.4f}" and cand["Loss-std"] == f"{np.std(cand_l, ddof=1):.4f}"
    assert cand["Loss-delta"] == f"{np.mean(cand_l) - np.mean(base_l):+.4f}"
    assert cand["p"] == f"{stats.ttest_1samp(cand_l, 3.28, alternative='less').pvalue:.3g}"
    assert base["Time-delta"] == "baseline" and base["Loss-delta"] == "baseline"
    _, runs = parse_markdown_table(out, "Group | File")
    assert len(runs) == 10 and {r["Status"] for r in runs} == {"finished"}
    assert runs[0]["GPU"] == "NVIDIA H200 x 1" and runs[0]["Step"] == "100/100"
    _, comparisons = parse_markdown_table(out, "Candidate")
    assert comparisons[0]["Candidate"] == "cand"
    assert float(comparisons[0]["Speedup"]) == pytest.approx(bt.mean() / ct.mean(), abs=1e-4)


def test_json_parses_back(two_groups, capsys):
    root, (base_l, base_t), (cand_l, cand_t) = two_groups
    rc, out, _ = run_main([root / "base", root / "cand", "--baseline", "base", "--json", "--target", "3.278"],
                          capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["target"] == 3.278 and data["baseline"] == "base"
    cand = next(g for g in data["groups"] if g["name"] == "cand")
    assert cand["n"] == 5 and len(cand["runs"]) == 5
    assert cand["loss_mean"] == pytest.approx(np.mean(cand_l), rel=1e-12)
    assert cand["p_below_target"] == pytest.approx(stats.ttest_1samp(cand_l, 3.278, alternative="less").pvalue)
    m, sd = np.mean(cand_l), np.std(cand_l, ddof=1)
    k = np.arange(2, 100_000)
    assert cand["runs_needed"] == int(k[np.argmax(stats.t.cdf((m - 3.278) / (sd / np.sqrt(k)), k - 1) < 0.01)])
    base = next(g for g in data["groups"] if g["name"] == "base")
    assert base["runs_needed"] == "never"  # base mean 3.27802 >= target 3.278
    comparison = data["comparisons"][0]
    expected = stats.ttest_ind(np.array(cand_t) / 1000, np.array(base_t) / 1000, equal_var=False,
                               alternative="less").pvalue
    assert comparison["p_time_candidate_faster"] == pytest.approx(expected, rel=1e-9)
    run = cand["runs"][0]
    assert run["val_loss"] == cand_l[0] and run["train_time_s"] == cand_t[0] / 1000
    assert run["val_curve"][0] == [0, 0.0, 10.8258]


def test_plot_writes_png(two_groups, capsys):
    root, _, _ = two_groups
    out_png = root / "curves.png"
    rc, _, _ = run_main([root / "base", root / "cand", "--plot", out_png], capsys)
    assert rc == 0
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bad_files_reported_others_compared(tmp_path, capsys):
    folder = tmp_path / "rec"
    folder.mkdir()
    write_log(folder / "good1.txt", 3.2771, 60000)
    write_log(folder / "good2.txt", 3.2779, 60400)
    write_log(folder / "truncated.txt", 3.2760, 60100, cut_final=True)
    (folder / "empty.txt").write_bytes(b"")
    (folder / "junk.log").write_bytes(bytes(range(256)) * 8)
    (folder / "notes.md").write_text("not a log: ignored, wrong suffix")
    rc, out, err = run_main([folder, "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    skipped = {Path(s["path"]).name: s["reason"] for s in data["skipped"]}
    assert skipped == {"empty.txt": "empty file", "junk.log": "binary content (NUL bytes)"}
    assert "skipped" in err and "empty.txt" in err
    group = data["groups"][0]
    assert (group["n"], group["n_excluded"]) == (2, 1)
    assert group["loss_mean"] == pytest.approx((3.2771 + 3.2779) / 2, rel=1e-12)
    assert any("truncated.txt excluded from statistics" in w for w in data["warnings"])


def test_exit_codes(tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    write_log(tmp_path / "unfinished.txt", 3.27, 60000, finish=False)
    rc, out, err = run_main([tmp_path / "empty.txt", tmp_path / "unfinished.txt"], capsys)
    assert rc == 1 and "no usable run" in err and "unfinished.txt" in out
    write_log(tmp_path / "good.txt", 3.27, 60000)
    assert run_main([tmp_path, "--baseline", "nope"], capsys)[0] == 2
    assert run_main(["--group", "no-equals-sign"], capsys)[0] == 2
    assert run_main([], capsys)[0] == 2
    assert run_main([tmp_path / "good.txt", "--plot", tmp_path / "no_dir" / "x.png"], capsys)[0] == 2
    assert run_main([tmp_path / "good.txt"], capsys)[0] == 0


@pytest.mark.parametrize("where", ["path", "group member"])
def test_a_path_that_does_not_exist_is_one_line_before_any_table(tmp_path, capsys, where):
    """A log named on the command line that is not there (a typo, a moved record): exit code 2 and one line naming
    it, before any table is printed; an unreadable or empty file that exists is still skipped and reported."""
    write_log(tmp_path / "good.txt", 3.27, 60000)
    absent = tmp_path / "absent.txt"
    argv = ([tmp_path / "good.txt", absent] if where == "path" else
            [tmp_path / "good.txt", "--group", f"g={tmp_path / 'good.txt'},{absent}"])
    rc, out, err = run_main(argv, capsys)
    assert (rc, out, err) == (2, "", f"error: {absent}: no such file or folder\n")


def test_explicit_groups(tmp_path, capsys):
    a = write_log(tmp_path / "a.txt", 3.2771, 60000)
    b = write_log(tmp_path / "b.txt", 3.2779, 60400)
    c = write_log(tmp_path / "c.txt", 3.2765, 58000)
    rc, out, _ = run_main(["--group", f"old={a},{b}", "--group", f"new={c}", "--baseline", "old", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert [(g["name"], g["n"]) for g in data["groups"]] == [("old", 2), ("new", 1)]
    assert data["comparisons"][0]["time_delta_s"] == pytest.approx(58.0 - 60.2, rel=1e-12)
    # A Welch test needs two runs per side.
    assert data["comparisons"][0]["p_time_two_sided"] is None


def test_same_folder_names_get_distinct_groups(tmp_path):
    for parent in ("x", "y"):
        (tmp_path / parent / "logs").mkdir(parents=True)
        write_log(tmp_path / parent / "logs" / "0.txt", 3.27, 60000)
    groups = compare.collect_groups([tmp_path / "x" / "logs", tmp_path / "y" / "logs"], [])
    assert len(groups) == 2 and all(len(files) == 1 for files in groups.values())


def test_seeds_may_differ_but_other_hyperparameters_may_not(tmp_path, capsys):
    """Repeats of one configuration use different seeds: only the other hyperparameters must agree."""
    (tmp_path / "g").mkdir()
    write_log(tmp_path / "g" / "a.txt", 3.2700, 100000, seed=0)
    write_log(tmp_path / "g" / "b.txt", 3.2750, 101000, seed=1)
    rc, out, _ = run_main([tmp_path / "g"], capsys)
    assert rc == 0 and "mixed hyperparameters" not in out
    write_log(tmp_path / "g" / "c.txt", 3.2720, 102000, seed=2, lr=0.03)
    rc, out, _ = run_main([tmp_path / "g"], capsys)
    assert "mixed hyperparameters (2 distinct settings)" in out


def test_stage_times_and_profile_tables_parsed(tmp_path):
    """stage_step_avg and the --profile-steps tables (train_gpt.py's lines, rank 0): per stage the mean step time;
    per profiled stage the steps, wall and busy time, the categories and the communication line (busy,
    overlapped, exposed), which logs before 2026-11-26 lack (stage 1 here)."""
    text = Path(write_log(tmp_path / "a.txt", 3.2, 60000)).read_text()
    head, events = text.rsplit(SEP + "\n", 1)
    profile = [
        "profile_stage0: steps 0..2, trace logs/a_profile_stage0_rank0.json",
        "profile: 3 steps, wall 750.00 ms, busy 700.50 ms (per step: 250.00 ms)",
        "   total ms  %wall  calls  category           kernel",
        "    300.000   40.0     33  matmul             nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
        "  communication: busy 90.00 ms, overlapped 60.00 ms (66.7%), exposed 30.00 ms",
        "  by category: communication 95.00 ms (12.7%)  optimizer 40.00 ms (5.3%)  attention 100.00 ms (13.3%)  "
        "matmul 300.00 ms (40.0%)  elementwise/other 170.00 ms (22.7%)  idle 49.50 ms (6.6%)",
        "profile_stage1: steps 3..3, trace logs/a_profile_stage1_rank0.json",
        "profile: 1 steps, wall 400.00 ms, busy 390.00 ms (per step: 400.00 ms)",
        "  by category: communication 0.00 ms (0.0%)  idle 10.00 ms (2.5%)",
    ]
    footer = "stage_step_avg: stage0:250.40ms stage1:410.25ms stage2:nanms"
    run = compare.parse_log_text(head + SEP + "\n" + "\n".join(profile) + "\n" + events + footer + "\n")
    assert run.stage_step_avg_ms == {0: 250.40, 1: 410.25, 2: None}
    assert run.profile[0] == {"steps": 3, "wall_ms": 750.0, "busy_ms": 700.5,
                              "communication": {"busy_ms": 90.0, "overlapped_ms": 60.0, "exposed_ms": 30.0},
                              "categories": {"communication": 95.0, "optimizer": 40.0, "attention": 100.0,
                                             "matmul": 300.0, "elementwise/other": 170.0, "idle": 49.5}}
    assert run.profile[1] == {"steps": 1, "wall_ms": 400.0, "busy_ms": 390.0,
                              "categories": {"communication": 0.0, "idle": 10.0}}
    assert run.usable and run.tokens_per_s_per_gpu == 812345


# ----------------------------------------------------------------------------------------------------------
# --at-step: val loss at equal steps over finished, unfinished and header-less runs


def write_console_log(path, val_losses, last_step, *, total=100, timestamps=True, step_ms=600):
    """Write train_gpt.py's console output without the source/header block, stopped after ``last_step``.

    ``val_losses``: {step: val loss}. With ``timestamps`` every line but the first carries an
    ``<epoch-seconds> `` prefix, as in a launcher's capture.
    """
    lines = ["log_file: /tmp/seeds/logs/x.txt", "val_tokens_used: 10485760 (40 micro-batches of 262144)",
             "compile_phase: stage0 T=16384 step 0: 60.7 s", "compile_warmup_s: 185.8", "compile_cache: cold"]
    for step in range(last_step + 1):
        t = step * step_ms
        avg = f"{t / step:.2f}" if step else "0.02"
        if step in val_losses:
            lines.append(f"step:{step}/{total} val_loss:{val_losses[step]:.4f} train_time:{t}ms step_avg:{avg}ms")
        if step > 0:
            lines.append(f"step:{step}/{total} train_time:{t}ms step_avg:{avg}ms")
    if timestamps:
        lines = [f"{1795691634.121215 + 0.25 * i:.6f} {line}" for i, line in enumerate(lines)]
    Path(path).write_text("\n".join(["launch 1795691600.000001 py:1 037420d", *lines]) + "\n")
    return path


@pytest.fixture
def at_step_groups(tmp_path):
    """base: finished with header, timestamped capture (unfinished), plain capture (unfinished), a capture cut
    before step 50; cand: two finished with header, one timestamped capture. Validation at steps 0 and 50."""
    base_50, cand_50 = [1.5302, 1.5441, 1.5313], [1.5338, 1.5407, 1.5384]
    for name in ("base", "cand"):
        (tmp_path / name).mkdir()
    write_log(tmp_path / "base" / "a_header.txt", 1.3281, 60000, mid_loss=base_50[0])
    write_console_log(tmp_path / "base" / "b_stamped.log", {0: 10.1174, 50: base_50[1]}, 53)
    write_console_log(tmp_path / "base" / "c_plain.log", {0: 10.1391, 50: base_50[2]}, 51, timestamps=False)
    write_console_log(tmp_path / "base" / "d_short.log", {0: 10.1266}, 30)
    write_log(tmp_path / "cand" / "a.txt", 1.3087, 59000, mid_loss=cand_50[0])
    write_log(tmp_path / "cand" / "b.txt", 1.3229, 59500, mid_loss=cand_50[1])
    write_console_log(tmp_path / "cand" / "c_stamped.log", {0: 10.1266, 50: cand_50[2]}, 50)
    return tmp_path, base_50, cand_50


def test_timestamped_capture_is_parsed(at_step_groups):
    """A console capture whose lines carry epoch-second prefixes: the prefixes are dropped, its val curve and
    compile time read; unfinished and header-less, so it stays out of the final-loss statistics."""
    root, base_50, _ = at_step_groups
    run = compare.parse_log(root / "base" / "b_stamped.log")
    assert run.val_curve == [(0, 0.0, 10.1174), (50, 30000.0, base_50[1])]
    assert (run.last_step, run.total_steps, run.finished, run.usable) == (53, 100, False, False)
    assert run.compile_warmup_s == 185.8 and run.source_hash is None
    assert any("no line of 100 '='" in p for p in run.problems)
    assert any("unfinished" in p for p in run.problems)


def test_at_step_json_matches_independent_arithmetic(at_step_groups, capsys):
    root, base_50, cand_50 = at_step_groups
    rc, out, _ = run_main([root / "base", root / "cand", "--baseline", "base", "--at-step", "50,0", "--json"],
                          capsys)
    assert rc == 0
    data = json.loads(out)
    rows = {(a["group"], a["step"]): a for a in data["at_step"]}
    assert [(a["group"], a["step"]) for a in data["at_step"]] == [("base", 50), ("base", 0), ("cand", 50),
                                                                 ("cand", 0)]
    assert set(rows["base", 50]) == {"group", "step", "n", "n_lacking", "lacking", "loss_mean", "loss_std",
                                     "loss_min", "loss_max", "loss_delta", "p_loss_two_sided"}
    base, cand = rows["base", 50], rows["cand", 50]
    assert (base["n"], base["n_lacking"], base["lacking"]) == (3, 1, ["d_short.log"])
    assert (cand["n"], cand["n_lacking"], cand["lacking"]) == (3, 0, [])
    for row, losses in ((base, base_50), (cand, cand_50)):
        assert row["loss_mean"] == pytest.approx(statistics.mean(losses), rel=1e-12)
        assert row["loss_std"] == pytest.approx(statistics.stdev(losses), rel=1e-9)
        assert (row["loss_min"], row["loss_max"]) == (min(losses), max(losses))
    assert base["loss_delta"] is None and base["p_loss_two_sided"] is None
    assert cand["loss_delta"] == pytest.approx(statistics.mean(cand_50) - statistics.mean(base_50), abs=1e-12)
    # Welch's t and Welch-Satterthwaite df written out, checked against scipy's test.
    va, vb = statistics.variance(cand_50) / 3, statistics.variance(base_50) / 3
    t = (statistics.mean(cand_50) - statistics.mean(base_50)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    assert cand["p_loss_two_sided"] == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9)
    assert cand["p_loss_two_sided"] == pytest.approx(
        stats.ttest_ind(cand_50, base_50, equal_var=False).pvalue, rel=1e-9)
    # Step 0: every run has it (the short capture too).
    assert rows["base", 0]["n"] == 4 and rows["base", 0]["loss_mean"] == pytest.approx(
        statistics.mean([10.8258, 10.1174, 10.1391, 10.1266]), rel=1e-12)
    # The unfinished runs stay excluded from the final-loss statistics and are listed as before.
    assert [g["n"] for g in data["groups"]] == [1, 2]
    assert any("b_stamped.log excluded from statistics" in w for w in data["warnings"])


def test_at_step_markdown_section(at_step_groups, capsys):
    root, base_50, cand_50 = at_step_groups
    rc, out, _ = run_main([root / "base", root / "cand", "--baseline", "base", "--at-step", "50"], capsys)
    assert rc == 0 and "## Val loss at equal steps" in out
    header, rows = parse_markdown_table(out, "Group | Step")
    assert header == ["Group", "Step", "n", "Lacking", "Loss-mean", "Loss-std", "Loss-min", "Loss-max",
                      "Loss-delta", "p loss (Welch, two-sided)"]
    base, cand = rows
    assert (base["Group"], base["Step"], base["n"], base["Lacking"]) == ("base", "50", "3", "1")
    assert base["Loss-mean"] == f"{statistics.mean(base_50):.4f}"
    assert base["Loss-std"] == f"{statistics.stdev(base_50):.4f}"
    assert base["Loss-delta"] == "baseline"
    assert cand["Loss-delta"] == f"{statistics.mean(cand_50) - statistics.mean(base_50):+.4f}"
    assert cand["p loss (Welch, two-sided)"] == f"{stats.ttest_ind(cand_50, base_50, equal_var=False).pvalue:.3g}"
    _, runs = parse_markdown_table(out, "Group | File")
    assert len(runs) == 7 and {r["File"]: r["Status"] for r in runs}["b_stamped.log"] == "excluded"


def test_at_step_unknown_p_with_one_run_and_no_baseline(at_step_groups, capsys):
    root, base_50, cand_50 = at_step_groups
    one = root / "cand" / "c_stamped.log"
    rc, out, _ = run_main(["--group", f"base={root / 'base'}", "--group", f"one={one}", "--baseline", "base",
                           "--at-step", "50"], capsys)
    assert rc == 0
    _, rows = parse_markdown_table(out, "Group | Step")
    assert (rows[1]["n"], rows[1]["Loss-std"], rows[1]["p loss (Welch, two-sided)"]) == ("1", "?", "?")
    assert rows[1]["Loss-delta"] == f"{cand_50[2] - statistics.mean(base_50):+.4f}"
    rc, out, _ = run_main([root / "cand", "--at-step", "50"], capsys)
    _, rows = parse_markdown_table(out, "Group | Step")
    assert (rows[0]["Loss-delta"], rows[0]["p loss (Welch, two-sided)"]) == ("-", "-")


def test_at_step_unfinished_only_exits_zero(at_step_groups, capsys):
    root, _, _ = at_step_groups
    files = [root / "base" / "b_stamped.log", root / "base" / "c_plain.log"]
    assert run_main([*files], capsys)[0] == 1  # no finished run, as before
    rc, out, _ = run_main([*files, "--at-step", "50", "--json"], capsys)
    assert rc == 0 and json.loads(out)["at_step"][0]["n"] == 2
    assert run_main([root / "base" / "d_short.log", "--at-step", "50"], capsys)[0] == 1


def test_without_at_step_output_unchanged(two_groups, capsys):
    """The option only adds its section (and JSON key) for logs the parser read before."""
    root, _, _ = two_groups
    args = [root / "base", root / "cand", "--baseline", "base"]
    _, plain, _ = run_main(args, capsys)
    _, with_steps, _ = run_main([*args, "--at-step", "50"], capsys)
    start = with_steps.index("## Val loss at equal steps")
    end = with_steps.index("## Runs")
    assert with_steps[:start] + with_steps[end:] == plain
    _, plain_json, _ = run_main([*args, "--json"], capsys)
    data = json.loads(plain_json)
    assert "at_step" not in data
    _, steps_json, _ = run_main([*args, "--json", "--at-step", "50"], capsys)
    steps_data = json.loads(steps_json)
    assert steps_data.pop("at_step") and steps_data == data


def test_at_step_repeated_validation_warned(tmp_path, capsys):
    path = write_console_log(tmp_path / "resumed.log", {0: 10.1, 50: 1.6}, 55)
    with open(path, "a") as f:  # a resumed run logging step 50 again
        f.write("1795691999.000001 step:50/100 val_loss:1.5500 train_time:30000ms step_avg:600.00ms\n")
    rc, out, _ = run_main([path, "--at-step", "50", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["at_step"][0]["loss_mean"] == 1.55
    assert any("2 validation lines at step 50" in w for w in data["warnings"])


@pytest.mark.parametrize("value", ["2.5", "abc", "-5", "250,", "", "250,x", "1e3"])
def test_bad_at_step_is_a_usage_error(at_step_groups, capsys, value):
    root, _, _ = at_step_groups
    with pytest.raises(SystemExit) as exc:
        compare.main([str(root / "base"), f"--at-step={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's one-line error after the usage
    assert ": error: argument --at-step: expects comma-separated integers >= 0" in last and value in last
