"""Tests of records/profile_compare.py on hand-made chrome traces: each kernel's category, idle time, the
per-step division, the compact form and bad arguments. The categories are written out again here per kernel."""
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("profile_compare", REPO / "records" / "profile_compare.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


# (name, start us, duration us, category the table must give it)
KERNELS = [
    ("nvjet_tst_128x256_h_bz_coopA", 0, 100, "matmul"),
    ("linear_relu_square_kernel", 100, 50, "matmul"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits>", 150, 40, "attention fwd"),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 190, 60, "attention bwd"),
    ("_ce_fwd_kernel", 250, 30, "cross entropy"),
    ("fused_softcapped_entropy_bwd_kernel", 280, 20, "cross entropy"),
    ("triton_poi_fused_add_mul_rms_norm_0", 300, 10, "elementwise/norms"),
    ("triton_red_fused__scaled_mm__to_copy_add_4", 305, 5, "elementwise/norms"),  # inductor names its fused ops
    ("triton_poi_fused_embedding_1", 50, 30, "elementwise/norms"),  # another stream, under the matmul: not idle
    ("Memcpy DtoD (Device -> Device)", 310, 5, "copies"),
    ("triton_tem_fused_mm_5", 312, 3, "matmul"),
    ("_transpose_kernel", 315, 5, "copies"),
    # 20 us of nothing: idle
    ("triton_per_fused_mul_sum_3", 340, 30, "optimizer"),       # inside the optimizer_step range
    ("_transpose_kernel", 370, 10, "optimizer"),                # a transpose inside it is the optimizer's
    ("ba_plus_cAA_kernel", 400, 20, "optimizer"),               # by name, outside the range
]


def trace(kernels=KERNELS):
    events = [kernel(n, a, d, "gpu_memcpy" if n.startswith("Memcpy") else "kernel") for n, a, d, _ in kernels]
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "optimizer_step", "ts": 335, "dur": 50})
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999})  # CPU side: ignored
    return {"traceEvents": events}


def write(path, obj):
    path.write_text(json.dumps(obj))
    return path


def expected_per_category():
    out = dict.fromkeys(pc.CATEGORIES, 0.0)
    for _, _, d, c in KERNELS:
        out[c] += d / 1e3
    out["idle"] = (20 + 20) / 1e3       # 320..340 and 380..400
    return out


def test_categories_idle_and_span(tmp_path):
    per_cat, per_kernel, span, ranges = pc.summarise(pc.load(write(tmp_path / "t.json", trace())))
    assert ranges == 1
    assert span == pytest.approx(0.420)
    for c, v in expected_per_category().items():
        assert per_cat[c] == pytest.approx(v), c
    assert per_kernel[("_transpose_kernel", "copies")] == (pytest.approx(0.005), 1)
    assert per_kernel[("_transpose_kernel", "optimizer")] == (pytest.approx(0.010), 1)


def test_table_divides_by_steps_and_micro_steps(tmp_path, capsys):
    a = write(tmp_path / "a.json", trace())
    slow = [(n, 2 * s, 2 * d, c) for n, s, d, c in KERNELS]   # every kernel and gap twice as long
    b = json.loads(json.dumps(trace(slow)))
    for e in b["traceEvents"]:
        if e["cat"] == "gpu_user_annotation":
            e["ts"], e["dur"] = 670, 100
    b = write(tmp_path / "b.json", b)
    pc.main([str(a), str(b), "--steps", "2", "--micro", "4", "--names", "x,y"])
    out = capsys.readouterr().out
    # matmul: 153 us over 2 steps = 0.0765 ms/step (0.019 per micro-step); y twice that; ratio 0.5
    assert "| matmul | 0.077 (0.019) | 0.153 (0.038) | 0.50 |" in out
    assert "| idle | 0.020 (0.005) | 0.040 (0.010) | 0.50 |" in out
    assert "| optimizer | 0.030 (0.007) | 0.060 (0.015) | 0.50 |" in out
    assert out.count("the 15 kernels with the most time") == 2


def test_steps_per_trace(tmp_path, capsys):
    """--steps 2,4: each trace divided by its own step count (a 2-step and a 4-step profile of the same work per
    step read the same)."""
    a = write(tmp_path / "a.json", trace())
    doubled = KERNELS + [(n, s + 1000, d, c) for n, s, d, c in KERNELS]   # the same kernels again: twice the steps
    b = json.loads(json.dumps(trace(doubled)))
    b = write(tmp_path / "b.json", b)
    pc.main([str(a), str(b), "--steps", "2,4", "--micro", "4", "--names", "x,y"])
    out = capsys.readouterr().out
    assert "(2 / 4 profiled steps;" in out
    assert "| attention bwd | 0.030 (0.007) | 0.030 (0.007) | 1.00 |" in out   # 60 us / 2 and 120 us / 4
    assert "| cross entropy | 0.025 (0.006) | 0.025 (0.006) | 1.00 |" in out
    for bad in ("2,4,6", "x", "2,"):
        with pytest.raises(SystemExit) as e:
            pc.main([str(a), str(b), "--steps", bad])
        assert e.value.code == 2 and capsys.readouterr().err.startswith("profile_compare.py: --steps")


def test_compact_form_gives_the_same_table(tmp_path, capsys):
    raw = write(tmp_path / "t.json", trace())
    small = tmp_path / "t.json.gz"
    pc.main(["--compact", str(raw), str(small)])
    with gzip.open(small, "rt") as f:
        assert set(json.load(f)) == {"kernels", "ranges"}
    pc.main([str(raw)])
    first = capsys.readouterr().out
    pc.main([str(small)])
    assert capsys.readouterr().out == first


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    for argv in ([str(tmp_path / "missing.json")], [], ["--compact", str(tmp_path / "missing.json"), "x.gz"]):
        with pytest.raises(SystemExit) as e:
            pc.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith("profile_compare.py:")


def test_a_trace_without_gpu_kernels_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no GPU kernels"):
        pc.summarise(pc.load(write(tmp_path / "cpu.json", {"traceEvents": []})))


def test_skip_steps_leaves_out_the_first_steps(tmp_path, capsys):
    """Two optimizer ranges end two steps; --skip-steps 1 keeps only what starts after the first one ends."""
    t = trace()
    t["traceEvents"].append({"ph": "X", "cat": "gpu_user_annotation", "name": "optimizer_step", "ts": 395, "dur": 30})
    per_cat, _, span, ranges = pc.summarise(pc.load(write(tmp_path / "t.json", t)), skip=1)
    assert ranges == 1
    assert span == pytest.approx(0.020)                  # ba_plus_cAA_kernel alone: 400..420
    assert per_cat["optimizer"] == pytest.approx(0.020)
    assert sum(per_cat.values()) == pytest.approx(0.020)
    with pytest.raises(SystemExit, match="needs more than 2"):
        pc.summarise(pc.load(tmp_path / "t.json"), skip=2)
    with pytest.raises(SystemExit) as e:
        pc.main([str(tmp_path / "t.json"), "--steps", "2", "--skip-steps", "2"])
    assert e.value.code == 2
