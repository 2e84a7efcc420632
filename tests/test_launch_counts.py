"""Tests of records/launch_counts.py on synthetic inductor output modules written in tmp_path.

The modules copy the shape of torch 2.11's inductor output (a ``Runner`` class whose
``call(self, args)`` allocates with ``empty_strided_cuda`` and launches by ``.run(``, ``extern_kernels.*`` and
``torch.ops.*``); the expected counts are written out by hand from their text below.
"""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("records_launch_counts", ROOT / "records" / "launch_counts.py")
launch_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_counts)

FORWARD = '''
# the backward of this graph (another module) takes tangents_1: only call's own text says forward or backward
from torch._inductor.runtime import triton_helpers
async_compile = AsyncCompile()
triton_poi_fused_mul_0 = async_compile.triton('triton_poi_fused_mul_0', """
def triton_poi_fused_mul_0(in_ptr0, out_ptr0, xnumel):
    pass
""")

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((16384, 768), (768, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [mul], Original ATen: [aten.mul]
            # triton_poi_fused_mul_0.run(commented, out)
            triton_poi_fused_mul_0.run(primals_1, buf0, 12582912, stream=stream0)
            triton_poi_fused_mul_1.run(buf0, buf0, 12582912, stream=stream0)
            buf1 = empty_strided_cuda((16384, 768), (768, 1), torch.bfloat16)
            triton_red_fused_sum_2.run(buf0, buf1, 16384, 768, stream=stream0)
            triton_per_fused__fused_rms_norm_3.run(buf1, buf0, 16384, 768, stream=stream0)
            triton_tem_fused_mm_4.run(buf0, buf1, stream=stream0)
            buf2 = empty_strided_cuda((768, 768), (768, 1), torch.bfloat16)
            buf7 = empty_strided_cuda((768, 2304), (2304, 1), torch.bfloat16)
            buf8 = empty_strided_cuda((768, 3072), (3072, 1), torch.bfloat16)
            buf9 = empty_strided_cuda((768, ), (1, ), torch.float32)
            extern_kernels.mm(buf0, primals_2, out=buf1)
            extern_kernels.mm(buf1, primals_2, out=buf0)
            extern_kernels.bmm(buf1, buf2, out=buf0)
            buf3 = torch.ops.speedrun.doc_attention_fwd.default(buf0, buf0, buf0)
            _linear_relu2_fwd_kernel_0.run(buf0, primals_2, buf1, stream=stream0)
            buf4 = empty_strided_cuda((2048, 12), (12, 1), torch.bfloat16)
            buf5 = empty_strided_cuda((16384, 12), (12, 1), torch.bfloat16)
            buf6 = empty_strided_cuda((50304, 768), (768, 1), torch.bfloat16)
        return (buf1, buf3)

    def helper(self):
        triton_poi_fused_mul_0.run(None, None, 1, stream=stream0)
        extern_kernels.mm(None, None, out=None)


runner = Runner(partitions=[])
call = runner.call
'''

BACKWARD = '''
class Runner:
    def call(self, args):
        primals_1, getitem_3, tangents_1 = args
        buf0 = empty_strided_cuda((32768, 768), (768, 1), torch.bfloat16)
        triton_red_fused_mul_sum_0.run(tangents_1, buf0, 72, 8192, stream=stream0)
        triton_per_fused_mul_sum_1.run(buf0, buf0, 1, 72, stream=stream0)
        triton_red_fused_mul_sum_2.run(tangents_1, buf0, 1, 32768, stream=stream0)
        extern_kernels.mm(buf0, primals_1, out=buf0)
        buf1 = torch.ops.speedrun.doc_attention_bwd.default(buf0, buf0)
        buf2 = torch.ops.speedrun.fp8_head_ce_bwd.default(buf0, buf0)
        return (buf0, None)
'''

KERNEL_ONLY = '''
@triton.jit
def triton_poi_fused_mul_0(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
'''


def write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_counts_one_forward_module_by_kind_and_stops_at_the_end_of_call():
    c = launch_counts.count(FORWARD)
    # inductor: mul_0, mul_1 (poi), sum_2 (red), rms_norm_3 (per), tem_4 (other); the commented .run and the
    # helper's are not launches of call
    assert (c["inductor"], c["by_kind"]) == (5, {"poi": 2, "red": 1, "per": 1, "other": 1})
    assert (c["ours"], c["extern"], c["ops"]) == (1, 3, 1)
    assert c["backward"] is False
    assert c["T"] == 16384  # three 16384 buffers, one each of 2048 and 50304; four of 768, under 1024
    assert c["names"] == {"triton_poi_fused_mul": 2, "triton_red_fused_sum": 1,
                          "triton_per_fused__fused_rms_norm": 1, "triton_tem_fused_mm": 1}


def test_a_backward_takes_tangents_and_a_module_without_call_is_none():
    c = launch_counts.count(BACKWARD)
    assert c["backward"] is True and c["T"] == 32768
    assert (c["inductor"], c["by_kind"]) == (3, {"poi": 0, "red": 2, "per": 1, "other": 0})
    assert (c["ours"], c["extern"], c["ops"]) == (0, 1, 2)
    assert c["names"] == {"triton_red_fused_mul_sum": 2, "triton_per_fused_mul_sum": 1}
    assert launch_counts.count(KERNEL_ONLY) is None


def test_scan_finds_modules_in_subfolders_the_most_launches_first(tmp_path):
    write(tmp_path, "ab/cabc.py", BACKWARD)        # 3 + 0 + 1 + 2 = 6 launches
    write(tmp_path, "x7/cx7forward.py", FORWARD)   # 5 + 1 + 3 + 1 = 10
    write(tmp_path, "ab/kernel.py", KERNEL_ONLY)   # not a graph
    write(tmp_path, "fxgraph/xy/entry", FORWARD)   # not a .py file
    found = launch_counts.scan(tmp_path)
    assert [p for p, _ in found] == ["x7/cx7forward.py", "ab/cabc.py"]
    lines = launch_counts.table(found, names=1)
    assert lines[2] == "| `x7/cx7forward.py` | forward | 16384 | 5 (2 / 1 / 1 / 1) | 1 | 3 | 1 | 10 |"
    assert lines[3] == "| `ab/cabc.py` | backward | 32768 | 3 (0 / 2 / 1 / 0) | 0 | 1 | 2 | 6 |"
    assert lines[4:] == ["- `x7/cx7forward.py`: triton_poi_fused_mul 2", "- `ab/cabc.py`: triton_red_fused_mul_sum 2"]
    assert launch_counts.table(found, top=1, names=0)[2:] == [lines[2]]


def test_command_line_prints_the_table_and_refuses_bad_input_with_one_line(tmp_path, capsys):
    write(tmp_path, "ab/cabc.py", BACKWARD)
    assert launch_counts.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| graph | kind | T |") and out[2].startswith("| `ab/cabc.py` | backward |")
    (tmp_path / "empty").mkdir()
    for argv, message in (([str(tmp_path / "none")], "not a folder"),
                          ([str(tmp_path / "empty")], "no inductor output module"),
                          ([str(tmp_path), "--top", "0"], "--top must be at least 1"),
                          ([str(tmp_path), "--names", "-1"], "--names must be at least 0")):
        assert launch_counts.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and err.startswith("launch_counts: ")


@pytest.mark.parametrize("indent", [0, 4])
def test_call_body_ends_at_the_next_line_of_its_def_indentation(indent):
    pad = " " * indent
    text = f"{pad}def call(args):\n{pad}    a.run(1)\n\n{pad}    b.run(2)\n{pad}x = 1\n{pad}    c.run(3)\n"
    assert launch_counts.call_body(text).split() == ["a.run(1)", "b.run(2)"]
    assert launch_counts.call_body("def other(args):\n    a.run(1)\n") is None
