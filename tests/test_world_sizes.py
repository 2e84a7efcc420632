"""World sizes 1, 2, 4 and 8 on the CPU (gloo; no GPU needed): the same math, the gradient
reduce-scatters started during the backward in one order on every rank, and the command that compares world
sizes side by side (records/world_sizes.py) on 1 and 2. The ranks of every world size run
tests/world_size_worker.py (three optimizer steps and a validation of a small smoke model, every rank
recording its micro-gradients, reduced rows, optimizer shards, losses, parameters and the order of its hooks
and collectives); the tests below read those records.

What "the same math" means here, step by step (tests/tolerances.py, rule 4): every slot's micro-gradient is
bitwise world size 1's (rank r computes slots r, r + W, ... with the loss scaled by 1/8, whatever W), each
reduced row is their sum within the fp32 bound of a sum in any order, each rank's optimizer shard is the rows
its reduce-scatter delivers, the logged losses differ from world size 1's by at most the order of their sum,
and, with the reductions done in world size 1's order (the worker), the parameters after three steps are
world size 1's bit for bit.
"""
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the smoke data (next = prev + 7..9 (mod 511), BOS 511) and the smoke model with two layers
from test_train_gpt import TWO_LAYER_FLAGS, _make_shard
from tolerances import UNIT_ROUNDOFF, assert_close_report, assert_sum_in_any_order, assert_two_sums_in_any_order, gamma

import train_gpt as tg

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "world_size_worker.py"
# records/ is a folder of records, not a package: load the command (and, through it, compare.py) by path.
_spec = importlib.util.spec_from_file_location("records_world_sizes", REPO / "records" / "world_sizes.py")
world_sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(world_sizes)
WORLD_SIZES = (1, 2, 4, 8)
# The smoke model with three layers instead of four: its Muon banks then hold 12 and 6 matrices, so at world
# sizes 4 and 8 their shards are padded (and some ranks hold no matrix at all), not only the small Adam tensors.
SMALL = {"num_layers": 3, "ve_tables": [0, -1, 0], "long_window_layers": [1, 2], "val_tokens": 2048}


# The CPU: GPUs hidden, one thread per rank (2 cores run 8 ranks).
CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")


def _write_data(d):
    _make_shard(d / "smoke_train_000001.bin", 120_000, 1)
    _make_shard(d / "smoke_val_000000.bin", 20_000, 3)
    return str(d / "smoke_train_*.bin"), str(d / "smoke_val_*.bin")


@pytest.fixture(scope="module")
def ws_data(tmp_path_factory):
    return _write_data(tmp_path_factory.mktemp("ws_data"))


@pytest.fixture(scope="module")
def ranks(shared_build):
    """{world size: [the record of each rank]} (tests/world_size_worker.py: one process that forks the ranks of
    each world size in turn), built once per session for all xdist workers."""
    return _ranks(shared_build, "world_sizes", SMALL)


@pytest.fixture(scope="module")
def ranks_qk_pairs(shared_build):
    """The same with --muon-qk-pairs and four heads of 16 (two pairs per W_q and W_k)."""
    return _ranks(shared_build, "world_sizes_qk_pairs", dict(SMALL, muon_qk_pairs=True, num_heads=4, head_dim=16))


def _ranks(shared_build, name, overrides):
    def build(folder):
        data = _write_data(folder)
        # its own session: on a timeout the ranks it forked go with it
        argv = [str(folder), *data, json.dumps(overrides), *map(str, WORLD_SIZES)]
        proc = subprocess.Popen([sys.executable, str(WORKER), *argv], cwd=REPO, env=CPU_ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        assert proc.returncode == 0, out[-6000:]

    root = shared_build(name, build)
    return {world: [torch.load(root / f"ws{world}" / f"rank{r}.pt", weights_only=False) for r in range(world)]
            for world in WORLD_SIZES}


# The tests on the ranks' records: one xdist worker builds them (the fixture's own lock keeps it to one build
# per session anyway; the group keeps a second worker from waiting on it).
on_ranks = pytest.mark.xdist_group("world_size_ranks")


def _slots(recs, step):
    """{slot: {name: micro-gradient}} of one step of one world size: rank r's micro-step j is slot r + j W."""
    world = len(recs)
    return {r + j * world: g for r, rec in enumerate(recs) for j, g in enumerate(rec["grads"][step])}


def _steps(recs):
    return range(len(recs[0]["steps"]))


def _rows(t, world, rank):
    """Rank ``rank``'s rows of ``t`` split along dim 0 into ``world`` equal parts, zero-padded (the layout the
    trainer promises: ceil(rows / world) rows each)."""
    k = -(-t.shape[0] // world)
    padded = torch.zeros((k * world, *t.shape[1:]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded[rank * k:(rank + 1) * k]


# ----------------------------------------------------------------------------------------------------
# Same math


@on_ranks
def test_every_slot_has_world_size_1s_micro_gradient(ranks):
    """The slot split and the loss scale: in every step, the micro-gradient of slot i is bitwise the one world
    size 1 computes for slot i: the same code on the same micro-batch and parameters (world size 1's at every
    step: the worker reduces in its order), one thread per rank (deterministic CPU kernels). A rank that takes
    other slots or scales its loss by its own micro-step count (1/(8/W)) instead of the global batch's (1/8)
    fails."""
    base = ranks[1]
    for world in WORLD_SIZES[1:]:
        for step in _steps(base):
            mine, ref = _slots(ranks[world], step), _slots(base, step)
            assert sorted(mine) == list(range(tg.SLOTS))
            for slot in range(tg.SLOTS):
                assert mine[slot].keys() == ref[slot].keys()
                for name, g in ref[slot].items():
                    ratio = (mine[slot][name].norm() / g.norm()).item() if g.norm() > 0 else math.nan
                    assert torch.equal(mine[slot][name], g), (
                        f"world size {world}, step {step}, slot {slot}: the gradient of {name} is not world size "
                        f"1's (norm ratio {ratio:.4g})")


@on_ranks
def test_reduced_rows_are_the_global_batch_sum(ranks):
    """Every reduce-scatter of every step, at every world size: rank r receives rows [r k, (r + 1) k) (k =
    ceil(rows / W)) of the sum of the 8 slots' micro-gradients (while tied, the LM head's rows add the
    embedding's, transposed: 16 terms), within rule 4's bound of their float64 sum; padding rows are exactly
    zero. The same parameters are reduced in each step at every world size. The setup really pads: some rank
    receives padding rows at every world size > 1, and at 4 and 8 also in a Muon bank (3-D, matrices at least
    model_dim wide), where some ranks hold padding only."""
    base = ranks[1]
    for world, recs in ranks.items():
        padded_rows, padded_banks, empty_bank_shards = 0, set(), 0
        for step in _steps(recs):
            slots = _slots(recs, step)
            for r, rec in enumerate(recs):
                assert rec["reduced"][step].keys() == base[0]["reduced"][step].keys(), (world, step, r)
                for name, got in rec["reduced"][step].items():
                    shape, parts = rec["initial"][name].shape, rec["contents"][step][name]
                    zero = torch.zeros(shape)  # the micro-gradient of a parameter no backward reaches (--xsa's alpha)
                    terms = [_rows(t if t.shape == shape else t.T, world, r)
                             for part in parts for t in (slots[i].get(part, zero) for i in slots)]
                    assert_sum_in_any_order(got, terms, name=f"world size {world}, step {step}, rank {r}, "
                                                              f"reduced rows of {'+'.join(parts)}")
                    k = -(-shape[0] // world)
                    pad = max(0, min(k, (r + 1) * k - shape[0]))
                    padded_rows += pad
                    if pad and len(shape) == 3 and min(shape[1:]) >= rec["model_dim"]:
                        padded_banks.add(name)
                        empty_bank_shards += pad == k
        if world > 1:
            assert padded_rows > 0, f"world size {world}: no shard was padded, the test lost its point"
        if world >= 4:
            assert padded_banks and empty_bank_shards, f"world size {world}: no Muon bank shard of padding only"


@on_ranks
def test_optimizer_shards_are_the_reduced_rows(ranks):
    """Rank r's optimizer holds, before any step, the same rows of every parameter that its reduce-scatter
    delivers: [r k, (r + 1) k) of the zero-padded parameter (fp32), so each row is updated with its own gradient.
    A shard offset by one row fails here (at world size 1 too), even where all world sizes agree."""
    for world, recs in ranks.items():
        for r, rec in enumerate(recs):
            for name, master in rec["masters"].items():
                want = _rows(rec["initial"][name].float(), world, r)
                assert master.shape == want.shape and torch.equal(master, want), (
                    f"world size {world}, rank {r}: the optimizer's shard of {name} is not rows "
                    f"[{r} k, {r + 1} k) of the parameter (k = {want.shape[0]})")


@on_ranks
def test_losses_and_parameters_are_world_size_1s(ranks):
    """The train loss of each step is the sum of the same 8 micro-losses (each / 8) in another order: within
    2 gamma_7 of world size 1's (rule 4; positive terms); the validation loss likewise, over its n micro-batches,
    plus one rounding of the division by n each. With the reductions in world size 1's order (the worker), every
    rank's parameters after the three steps (the third unties the embedding) are world size 1's, bit for bit."""
    base = ranks[1][0]
    n_val, u = base["val_micro"], UNIT_ROUNDOFF[torch.float32]
    for world, recs in ranks.items():
        for r, rec in enumerate(recs):
            for step, (a, b) in enumerate(zip(rec["losses"], base["losses"])):
                assert_two_sums_in_any_order(a, b, tg.SLOTS, max(a, b) / (1 - gamma(tg.SLOTS - 1)),
                                             name=f"world size {world}, rank {r}, train loss of step {step}")
            a, b = rec["val_loss"], base["val_loss"]
            bound = (2 * gamma(n_val - 1) / (1 - gamma(n_val - 1)) + 2 * u) * max(a, b)
            assert_close_report(torch.tensor(a), torch.tensor(b), atol=bound,
                                name=f"world size {world}, rank {r}, validation loss ({n_val} micro-batches)")
            for name, p in base["params"].items():
                q = rec["params"][name]
                diff = (q.double() - p.double()).abs().max().item()
                assert torch.equal(q, p), (f"world size {world}, rank {r}: {name} after the steps differs from "
                                           f"world size 1's (max |diff| {diff:.3e})")
    assert any(not torch.equal(base["params"][k], v) for k, v in base["initial"].items()), "nothing moved"


@pytest.mark.xdist_group("world_size_ranks_qk_pairs")
def test_muon_qk_pairs_parameters_are_world_size_1s(ranks_qk_pairs):
    """--muon-qk-pairs: every rank's parameters after the three steps are world size 1's, bit for bit, at world
    sizes 2, 4 and 8, where a rank's shard starts at any matrix of attn_bank's [W_q, W_k, W_v, W_o] cycle (or holds
    padding only): which rows are split into pairs of heads follows the global index."""
    base = ranks_qk_pairs[1][0]
    assert not torch.equal(base["params"]["attn_bank"], base["initial"]["attn_bank"]), "attn_bank did not move"
    for world, recs in ranks_qk_pairs.items():
        for r, rec in enumerate(recs):
            for name, p in base["params"].items():
                assert torch.equal(rec["params"][name], p), f"world size {world}, rank {r}: {name} differs"


# ----------------------------------------------------------------------------------------------------
# Communication during the backward, in one order


@on_ranks
def test_reduce_scatters_start_during_the_backward_in_one_order(ranks):
    """From each rank's event order (gradient hooks, reduce-scatter launches, backward ends, collectives), in
    every step: some reduce-scatter is launched while the last micro-step's backward still computes gradients
    (before its last gradient is complete, so before the backward ends); a reduce-scatter launched inside the
    backward comes after every gradient its buffer sums (in the last micro-step); no buffer is reduced twice.
    Across the ranks of a world size, the sequence of reduce-scatters and the sequence of all collectives
    (operation, shape, dtype) are the same: NCCL deadlocks or mixes buffers otherwise."""
    for world, recs in ranks.items():
        for r, rec in enumerate(recs):
            ev = rec["events"]
            last = tg.SLOTS // world - 1
            for step in _steps(recs):
                where = f"world size {world}, rank {r}, step {step}"
                end = ev.index(("backward_end", step, last))
                grads = {e[3]: i for i, e in enumerate(ev) if e[:3] == ("grad", step, last)}
                launches = [(i, e[3]) for i, e in enumerate(ev) if e[:2] == ("rs", step)]
                order = " ".join(f"{n}{'' if i < end else '(after)'}" for i, n in launches)
                assert any(i < max(grads.values()) for i, _ in launches), (
                    f"{where}: no reduce-scatter starts before the backward's last gradient is complete; "
                    f"launches in order ('after': after the backward ended): {order}")
                assert len({n for _, n in launches}) == len(launches), f"{where}: a buffer reduced twice: {order}"
                for i, name in launches:
                    if i < end:
                        for part in rec["contents"][step][name]:
                            assert grads[part] < i, f"{where}: {name} reduced before the gradient of {part}"
        for r, rec in enumerate(recs[1:], 1):
            for kind in ("rs", "collective"):
                mine = [e[1:] if kind == "collective" else (e[1], e[3]) for e in rec["events"] if e[0] == kind]
                ref = [e[1:] if kind == "collective" else (e[1], e[3]) for e in recs[0]["events"] if e[0] == kind]
                assert mine == ref, f"world size {world}: rank {r}'s {kind} sequence differs from rank 0's"


# ----------------------------------------------------------------------------------------------------
# The comparison command: records/world_sizes.py


@pytest.mark.runs_long
def test_world_sizes_command_on_1_and_2_cpu_ranks(ws_data, tmp_path, capsys):
    """``python records/world_sizes.py --nproc 1,2 --json -- --smoke ...``: two smoke steps (two layers) at world
    sizes 1 and 2 (gloo), one profiled step per stage, a final validation of 8 micro-batches (the fewest). Per
    world size: tokens/s per GPU, every stage's ms/step and, per profiled stage, the communication time per step (none at world size 1; the gloo collectives at 2),
    its overlapped share and exposed time (busy = overlapped + exposed). The first step's train loss (before any
    update) is the same 8 micro-losses summed in another order: rule 4, plus half a unit of the 6th decimal each
    as printed. ``--logs`` on the same logs prints the Markdown table with these numbers."""
    train, val = ws_data
    flags = ["--smoke", "--train-files", train, "--val-files", val, "--steps", "2", "--extension-steps", "0",
             "--val-every", "0", "--val-tokens", "2048", *TWO_LAYER_FLAGS]
    res = subprocess.run([sys.executable, str(REPO / "records" / "world_sizes.py"), "--nproc", "1,2", "--out",
                          str(tmp_path), "--run-id", "cmp", "--profile-steps", "1", "--json", "--", *flags],
                         cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(res.stdout)
    assert [r["world_size"] for r in rows] == [1, 2] and all(r["exit_code"] == 0 and not r["problem"] for r in rows)
    for r in rows:
        assert r["log"] == str(tmp_path / f"cmp_ws{r['world_size']}.txt") and r["tokens_per_s_per_gpu"] > 0
        assert set(r["stage_ms"]) == {"0", "1"} and all(v > 0 for v in r["stage_ms"].values())
        assert set(r["profile"]) == {"0", "1"}
        for p in r["profile"].values():
            assert p["wall_ms"] > 0 and 0 <= p["comm_exposed_ms"] <= p["comm_ms"]
            if r["world_size"] == 1:
                assert p["comm_ms"] == 0 and p["comm_overlapped"] is None
            else:
                assert p["comm_ms"] > 0 and 0 <= p["comm_overlapped"] <= 1
                # busy - overlapped = exposed, up to the rounding of the three as logged (0.005 ms each)
                assert abs(p["comm_ms"] * (1 - p["comm_overlapped"]) - p["comm_exposed_ms"]) <= 0.015 + 1e-9
    (s1, a), (s2, b) = (world_sizes.parse_log(r["log"]).train_losses[0] for r in rows)
    assert s1 == s2 == 1
    bound = 2 * gamma(tg.SLOTS - 1) * max(a, b) / (1 - gamma(tg.SLOTS - 1)) + 1e-6
    assert_close_report(torch.tensor(a), torch.tensor(b), atol=bound, name="train loss of the first step")

    assert world_sizes.main(["--logs", *(r["log"] for r in rows)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| | world size 1 | world size 2 |" and table[1] == "| --- | --- | --- |"
    cells = {}
    for line in table[2:]:
        name, *values = (c.strip() for c in line.strip("|").split("|"))
        cells[name] = values
    tok = [r["tokens_per_s_per_gpu"] for r in rows]
    assert cells["tokens/s per GPU"] == [f"{t:.0f}" for t in tok]
    assert cells["per GPU vs world size 1"] == ["1.00", f"{tok[1] / tok[0]:.2f}"]
    for stage in ("0", "1"):
        assert cells[f"stage{stage} ms/step"] == [f"{r['stage_ms'][stage]:.2f}" for r in rows]
        assert cells[f"stage{stage} comm ms/step"] == [f"{r['profile'][stage]['comm_ms']:.2f}" for r in rows]
        share = rows[1]["profile"][stage]["comm_overlapped"]
        assert cells[f"stage{stage} comm overlapped"] == ["?", f"{100 * share:.1f}%"]  # no collective at 1


def test_world_sizes_table_marks_a_failed_run(tmp_path):
    """A run that failed (no log): its column says so and every number is unknown; the exit status is 1."""
    rows = [world_sizes.summary(tmp_path / "missing.txt", code=1)]
    text = world_sizes.table(rows)
    assert text.splitlines()[0].startswith("| | world size ? (failed: exit code 1, cannot read")
    assert "| tokens/s per GPU | ? |" in text
    assert world_sizes.main(["--logs", str(tmp_path / "missing.txt")]) == 1
