"""Tests of data/hellaswag.py (loading, rendering, a mocked download: no network) and, end to end on a smoke
checkpoint, of train_gpt.py's --hellaswag (against a scorer written again here, one candidate at a time),
--hellaswag-every, --sample and their command-line errors (evaluation.py itself: test_evaluation.py).

The smoke model has 512 ids, so its HellaSwag file (tests/fixtures/hellaswag_numbers.jsonl) is written in
numbers and a stand-in tokenizer reads them (GPT-2's BPE needs files that may be absent offline).
"""
import io
import json
import os
import re
import subprocess
import sys
import time
import types
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

import evaluation as ev
import run_log
import train_gpt as tg
from distributed import Dist
from data import hellaswag as hs
# the smoke data (next = prev + 7..9 (mod 511), BOS 511) and the smoke model with two layers
from test_train_gpt import SMOKE_RUN_VAL, TWO_LAYER_FLAGS, _make_shard

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SAMPLE = FIXTURES / "hellaswag_val_sample.jsonl"
NUMBERS = FIXTURES / "hellaswag_numbers.jsonl"
# tiktoken's gpt2 files: TIKTOKEN_CACHE_DIR, or the team's shared copy beside the checkout or its worktree folder
GPT2_CACHES = (REPO.parent / "shared" / "tiktoken_cache", REPO.parent.parent / "shared" / "tiktoken_cache")
EVAL_JUMP_S = 1000.0  # an evaluation's extra time in the smoke run (a jump of the trainer's clock, no sleep)
GPT2_FILES = ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")


def _gpt2_cache_dir():
    for c in (os.environ.get("TIKTOKEN_CACHE_DIR"), *GPT2_CACHES):
        if c and all((Path(c) / f).is_file() for f in GPT2_FILES):
            return Path(c)
    return None


class NumberEncoding:
    """Stand-in tokenizer: a text of decimal numbers is its token ids."""

    def encode_ordinary(self, s):
        return [int(t) for t in s.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


def byte_encoding():
    return tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={})


# ----------------------------------------------------------------------------------------------------
# Loading and rendering


def test_load_fixture_and_limit():
    ex = hs.load_examples(SAMPLE)
    assert [e.label for e in ex] == [3, 0, 1]
    assert ex[0].ctx == "A man is sitting on a roof. he"
    assert ex[0].endings[3] == "starts pulling up roofing on a roof." and len(ex[2].endings) == 4
    assert [e.label for e in hs.load_examples(SAMPLE, limit=2)] == [3, 0]
    assert len(hs.load_examples(SAMPLE, limit=10)) == 3


@pytest.mark.parametrize("line, what", [
    ('{"ctx": "a", "endings": ["b", "c", "d"', "not JSON"),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', "'endings' (4 non-empty texts)"),
    ('{"ctx": "a", "endings": ["b", "c", "d", ""], "label": 0}', "'endings' (4 non-empty texts)"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', "'label' (0..3)"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": "1"}', "'label' (0..3)"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": true}', "'label' (0..3)"),
    ('{"endings": ["b", "c", "d", "e"], "label": 1}', "'ctx' (text)"),
    ('[1, 2]', "'ctx' (text)"),
])
def test_malformed_line_is_named(tmp_path, line, what):
    p = tmp_path / "x.jsonl"
    p.write_text(SAMPLE.read_text().splitlines()[0] + "\n\n" + line + "\n")
    with pytest.raises(hs.HellaSwagError, match=rf"x\.jsonl:3: .*") as info:
        hs.load_examples(p)
    assert what in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(hs.HellaSwagError, match=r"no HellaSwag file at .*python data/hellaswag\.py"):
        hs.load_examples(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(hs.HellaSwagError, match="holds no examples"):
        hs.load_examples(tmp_path / "e.jsonl")


def test_render_bytes_leading_space():
    """With a byte-level encoding the ids are the UTF-8 bytes: the endings start with a space (32)."""
    ex = hs.load_examples(SAMPLE)[1]
    ctx, ends, label = hs.render(ex, byte_encoding().encode_ordinary)
    assert ctx == list(ex.ctx.encode()) and label == 0
    assert len(ends) == 4
    for e, ids in zip(ex.endings, ends):
        assert ids == [32] + list(e.encode())


@pytest.mark.skipif(_gpt2_cache_dir() is None, reason="tiktoken's gpt2 files are not available offline")
def test_render_gpt2(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_gpt2_cache_dir()))
    enc = tiktoken.get_encoding("gpt2")
    ex = hs.Example("Hello", ("world", "A man is sitting on a roof.", "x", "<|endoftext|>"), 2)
    ctx, ends, label = hs.render(ex, enc.encode_ordinary)
    assert ctx == [15496] and label == 2
    assert ends[0] == [995]  # " world"; "world" without the space would be 6894
    assert ends[1] == [317, 582, 318, 5586, 319, 257, 9753, 13]  # " A man is sitting on a roof."
    assert 50256 not in ends[3]  # special-token text stays text
    ex = hs.load_examples(SAMPLE)[0]
    ctx, ends, _ = hs.render(ex, enc.encode_ordinary)
    assert len(ctx) == 9 and ends[3] == [4940, 10427, 510, 9753, 278, 319, 257, 9753, 13]


# ----------------------------------------------------------------------------------------------------
# Download (a fake urlopen: no network)


def _source(content, url="https://example.invalid/hellaswag_val.jsonl"):
    return hs.Source("hellaswag_val.jsonl", url, len(content.decode().splitlines()), hs.git_blob_sha1(content))


class FakeResponse:
    def __init__(self, status, body, length=None):
        self.status, self._body = status, io.BytesIO(body)
        self.headers = {"Content-Length": str(len(body) if length is None else length)}

    def read(self, n):
        return self._body.read(n)


class FakeServer:
    """Serves `content` (honouring Range unless told not to); `cut` stops a reply after that many bytes while
    announcing the full length (a dropped connection); `error` raises instead."""

    def __init__(self, content, ranges=True, cut=None, error=None):
        self.content, self.ranges, self.cut, self.error = content, ranges, cut, error
        self.requests = []

    def __call__(self, request, timeout=None):
        rng = request.get_header("Range")
        self.requests.append(rng)
        if self.error is not None:
            raise self.error
        start = int(rng[len("bytes="):-1]) if rng and self.ranges else 0
        if rng and self.ranges and start >= len(self.content):
            raise urllib.error.HTTPError(request.full_url, 416, "Range Not Satisfiable", {}, None)
        body = self.content[start:]
        sent = body if self.cut is None else body[:self.cut]
        return FakeResponse(206 if rng and self.ranges else 200, sent, length=len(body))


CONTENT = SAMPLE.read_bytes()


def test_git_blob_id_matches_git(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(CONTENT)
    out = subprocess.run(["git", "hash-object", str(p)], capture_output=True, text=True, check=True).stdout
    assert hs.git_blob_sha1(CONTENT) == out.strip()


def test_download_verifies_and_renames(tmp_path, capsys):
    server = FakeServer(CONTENT)
    path = hs.download(tmp_path / "hs", _source(CONTENT), opener=server)
    assert path == tmp_path / "hs" / "hellaswag_val.jsonl" and path.read_bytes() == CONTENT
    assert not (tmp_path / "hs" / "hellaswag_val.jsonl.part").exists()
    assert server.requests == [None]
    out, err = capsys.readouterr()
    assert "ok (3 examples)" in out and "(100%)" in err
    # present and valid: no request
    hs.download(tmp_path / "hs", _source(CONTENT), opener=server)
    assert server.requests == [None] and "present, ok" in capsys.readouterr().out


def test_present_invalid_file_is_downloaded_again(tmp_path, capsys):
    (tmp_path / "hellaswag_val.jsonl").write_bytes(CONTENT[:-40])
    hs.download(tmp_path, _source(CONTENT), opener=FakeServer(CONTENT))
    assert (tmp_path / "hellaswag_val.jsonl").read_bytes() == CONTENT
    assert "present but invalid" in capsys.readouterr().out


def test_dropped_connection_keeps_part_and_next_run_resumes(tmp_path):
    src = _source(CONTENT)
    with pytest.raises(hs.HellaSwagError, match=r"stopped at 100 of \d+ bytes; run the same command again"):
        hs.download(tmp_path, src, opener=FakeServer(CONTENT, cut=100))
    part = tmp_path / "hellaswag_val.jsonl.part"
    assert part.read_bytes() == CONTENT[:100] and not (tmp_path / "hellaswag_val.jsonl").exists()
    server = FakeServer(CONTENT)
    hs.download(tmp_path, src, opener=server)
    assert server.requests == ["bytes=100-"]
    assert (tmp_path / "hellaswag_val.jsonl").read_bytes() == CONTENT and not part.exists()


def test_server_without_ranges_restarts(tmp_path, capsys):
    (tmp_path / "hellaswag_val.jsonl.part").write_bytes(b"garbage that is not a prefix")
    server = FakeServer(CONTENT, ranges=False)
    hs.download(tmp_path, _source(CONTENT), opener=server)
    assert server.requests == ["bytes=28-"]
    assert (tmp_path / "hellaswag_val.jsonl").read_bytes() == CONTENT
    assert "does not resume; starting again" in capsys.readouterr().err


def test_whole_part_file_is_verified_on_416(tmp_path):
    (tmp_path / "hellaswag_val.jsonl.part").write_bytes(CONTENT)
    hs.download(tmp_path, _source(CONTENT), opener=FakeServer(CONTENT))
    assert (tmp_path / "hellaswag_val.jsonl").read_bytes() == CONTENT


@pytest.mark.parametrize("served, match", [
    (CONTENT.replace(b"roof", b"ROOF"), "differs from the published file"),
    (CONTENT.split(b"\n", 1)[1], "has 2 examples, expected 3"),
    (b"\xff\xfe" + CONTENT, "not UTF-8"),
])
def test_corrupt_download_is_deleted(tmp_path, served, match):
    with pytest.raises(hs.HellaSwagError, match=f"failed verification and was deleted: .*{match}"):
        hs.download(tmp_path, _source(CONTENT), opener=FakeServer(served))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("error", [urllib.error.URLError(OSError(-2, "Name or service not known")),
                                   TimeoutError("timed out"), ConnectionResetError(104, "reset"),
                                   urllib.error.HTTPError("u", 404, "Not Found", {}, None)])
def test_offline_is_one_sentence_exit_2(tmp_path, monkeypatch, capsys, error):
    monkeypatch.setattr(hs.urllib.request, "urlopen", FakeServer(CONTENT, error=error))
    assert hs.main(["--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hellaswag.py: error: cannot download {hs.VAL.url} (")
    assert "by hand" in err[0]


def test_real_source_is_pinned():
    assert hs.VAL.url.endswith(f"/rowanz/hellaswag/{hs.COMMIT}/data/hellaswag_val.jsonl")
    assert hs.VAL.examples == 10_042 and len(hs.VAL.git_blob_sha1) == 40


def test_script_help_from_anywhere(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "data" / "hellaswag.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "rowanz/hellaswag" in res.stdout


# ----------------------------------------------------------------------------------------------------
# End to end on a smoke run: --hellaswag-every, --hellaswag CHECKPOINT, --sample


@pytest.fixture
def number_tokenizer(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: NumberEncoding()))


# The tests of the smoke run below share it: one xdist worker builds it (where groups work: conftest.py).
on_smoke_run = pytest.mark.xdist_group("hellaswag_smoke_run")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("hs_smoke")
    _make_shard(d / "smoke_train_000001.bin", 60_000, 1)
    _make_shard(d / "smoke_val_000000.bin", 20_000, 3)
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: NumberEncoding()))
    evaluate = tg.HellaSwag.evaluate
    # The trainer's and the step clock's time.perf_counter, which each evaluation moves EVAL_JUMP_S ahead: an
    # evaluation that takes that much longer, which the clock must not count (a sleep would cost the suite time).
    jumps, perf_counter = [0.0], time.perf_counter
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.perf_counter = lambda: perf_counter() + jumps[0]
    mp.setattr(tg, "time", clock)
    mp.setattr(run_log, "time", clock)

    def slow_evaluate(*args, **kwargs):
        jumps[0] += EVAL_JUMP_S
        return evaluate(*args, **kwargs)

    mp.setattr(tg.HellaSwag, "evaluate", slow_evaluate)
    try:
        log_path, ckpt_dir = tg.main([
            "--smoke", "--train-files", str(d / "smoke_train_*.bin"), "--val-files", str(d / "smoke_val_*.bin"),
            "--log-dir", str(d / "logs"), "--checkpoint-dir", str(d / "ckpt"), "--run-id", "hs",
            "--steps", "4", "--extension-steps", "1", "--val-every", "0", *SMOKE_RUN_VAL,
            "--hellaswag-every", "2", "--hellaswag-file", str(NUMBERS), *TWO_LAYER_FLAGS])
    finally:
        mp.undo()
    return Path(log_path), Path(ckpt_dir) / "step_000005"


@on_smoke_run
def test_hellaswag_every_logs_outside_the_clock(smoke_run):
    log_path, _ = smoke_run
    events = log_path.read_text().split("=" * 100 + "\n")[-1].splitlines()  # after the source and header
    hs_lines = [ln for ln in events if "hellaswag" in ln]
    assert [ln.split()[0] for ln in hs_lines] == ["step:0/5", "step:2/5", "step:4/5", "step:5/5"]
    values = [float(ln.split("hellaswag_acc_norm:")[1]) for ln in hs_lines]
    for ln, v in zip(hs_lines, values):
        assert 0 <= v <= 1 and ln == f"{ln.split()[0]} hellaswag_acc_norm:{v:.4f}"
    # The clock stops: none of the 3 evaluations before step 5 (each EVAL_JUMP_S long) is in its train_time or in
    # a step's, and the train_time is the sum of the 5 steps' own durations (stage_step_avg: 2, 2 and 1 steps) up
    # to the host's few milliseconds between a step's end and a clock stop (timed, but no step's).
    text = "\n".join(events)
    train_ms = float(re.search(r"^step:5/5 train_time:([\d.]+)ms", text, re.M)[1])
    avg = [float(x) for x in re.findall(r"stage\d:([\d.]+)ms", text)]
    assert len(avg) == 3
    assert train_ms < 1000 * EVAL_JUMP_S, f"an evaluation was timed: train_time {train_ms} ms"
    assert abs(train_ms - (2 * avg[0] + 2 * avg[1] + avg[2])) < 100, (train_ms, avg)


def _reference_scores(hp, params, fns, device):
    """Every candidate scored alone (its own sequence [BOS] + ctx + ending, through the layers and head_logits),
    log-softmax and sums in float64: (sums, token counts), (8, 4) arrays, and the labels."""
    sums, counts, labels = np.zeros((8, 4)), np.zeros((8, 4)), []
    for e, ex in enumerate(hs.load_examples(NUMBERS)):
        ctx, ends, label = hs.render(ex, NumberEncoding().encode_ordinary)
        labels.append(label)
        for j, end in enumerate(ends):
            ids = [hp.bos_id] + ctx + end
            T = -(-len(ids) // tg.BLOCK) * tg.BLOCK
            x = torch.tensor(ids + [hp.bos_id] * (T - len(ids)), dtype=torch.int32, device=device)
            with torch.no_grad():
                h = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(x), hp.stages[-1].windows, {}))
                logp = torch.log_softmax(tg.head_logits(h, params["lm_head"], hp.softcap).double(), -1)
            sums[e, j] = sum(logp[len(ctx) + i, t].item() for i, t in enumerate(end))
            counts[e, j] = len(end)
    return sums, counts, np.array(labels)


@on_smoke_run
def test_hellaswag_checkpoint_matches_one_candidate_at_a_time(smoke_run, number_tokenizer, capsys, device):
    """--hellaswag on the smoke checkpoint (bf16, on the test device): the accuracies printed and saved are
    those of the reference computed one candidate at a time on the same device; each evaluation saves its result
    in a new file (hellaswag_1.json, then hellaswag_2.json), whose path it prints."""
    _, ckpt = smoke_run
    res = tg.main(["--hellaswag", str(ckpt), "--hellaswag-file", str(NUMBERS), "--hellaswag-limit", "8"])
    dev = torch.device(device)
    sums, counts, labels = _reference_scores(*tg.load_model(ckpt, Dist(device=dev)), dev)
    right, right_norm = (sums.argmax(1) == labels).sum(), ((sums / counts).argmax(1) == labels).sum()
    assert res["examples"] == 8 and (res["acc"], res["acc_norm"]) == (right / 8, right_norm / 8)
    line = f"hellaswag acc: {right / 8:.4f} acc_norm: {right_norm / 8:.4f} (8 examples)"
    out = capsys.readouterr().out
    assert line in out and f"\nhellaswag_result: {ckpt / 'hellaswag_1.json'}\n" in out
    first = (ckpt / "hellaswag_1.json").read_text()
    saved = json.loads(first)
    assert saved["acc"] == res["acc"] and saved["examples"] == 8 and saved["file"] == str(NUMBERS)
    # A second evaluation writes a file of its own: the first result stays as it was.
    assert tg.main(["--hellaswag", str(ckpt), "--hellaswag-file", str(NUMBERS), "--hellaswag-limit", "3"])[
        "examples"] == 3
    assert f"\nhellaswag_result: {ckpt / 'hellaswag_2.json'}\n" in capsys.readouterr().out
    assert (ckpt / "hellaswag_1.json").read_text() == first
    assert json.loads((ckpt / "hellaswag_2.json").read_text())["examples"] == 3


@on_smoke_run
def test_packed_scores_match_one_candidate_at_a_time(smoke_run, device):
    """The smoke checkpoint in fp32 (so packing's other positions change only fp32 rounding): the packed
    sums equal the one-candidate-at-a-time sums to 1e-3 nats (4-token endings sum to about -20 here and
    differ by up to ~4 nats; a wrong row or target moves a sum by tenths of a nat or more)."""
    _, ckpt = smoke_run
    dev = torch.device(device)
    hp, params, fns = tg.load_model(ckpt, Dist(device=dev))
    hp = tg.dataclasses.replace(hp, param_dtype="float32", hellaswag_file=str(NUMBERS))
    params = {k: v.float() for k, v in params.items()}
    ref_s, ref_c, _ = _reference_scores(hp, params, fns, dev)
    h = ev.HellaSwag(hp, Dist(device=dev), tg.BLOCK, NumberEncoding())
    assert len(h.packs) == 1
    total, count = ev.hellaswag_scores(tg.model_logits(hp, params, fns, {}), h.packs, 8, dev)
    np.testing.assert_allclose(total.cpu().numpy(), ref_s, rtol=0, atol=1e-3)
    assert np.array_equal(count.cpu().numpy(), ref_c) and np.ptp(ref_s) > 1, "scores too alike to tell bugs apart"


def _sample(ckpt, *extra):
    return tg.main(["--sample", str(ckpt), "--prompt", "100 108 116", "--max-new-tokens", "6", *extra])


@on_smoke_run
def test_sampling_seed_temperature_top_k(smoke_run, number_tokenizer, capsys):
    _, ckpt = smoke_run
    greedy = _sample(ckpt)
    assert len(greedy) == 1 and greedy[0].startswith("100 108 116 ") and len(greedy[0].split()) == 9
    assert _sample(ckpt, "--temperature", "0", "--num-samples", "2", "--seed", "4") == greedy * 2
    assert _sample(ckpt, "--temperature", "1.5", "--top-k", "1") == greedy
    a = _sample(ckpt, "--temperature", "1", "--num-samples", "3", "--seed", "1")
    assert a == _sample(ckpt, "--temperature", "1", "--num-samples", "3", "--seed", "1")
    assert a != _sample(ckpt, "--temperature", "1", "--num-samples", "3", "--seed", "2")
    assert len(set(a)) > 1, "three samples at temperature 1 should differ"
    out = capsys.readouterr().out
    assert "--- sample 3/3" in out and a[2] in out


@on_smoke_run
def test_sequence_logits_padding_and_prefix(smoke_run):
    """Right padding is harmless: the logits of a prefix equal the first rows of the longer sequence's."""
    _, ckpt = smoke_run
    hp, params, fns = tg.load_model(ckpt, Dist())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 511, (150,), generator=g, dtype=torch.int32)
    ids[0] = ids[90] = hp.bos_id
    full = tg.sequence_logits(hp, params, fns, ids, {})
    assert full.shape == (150, 512) and full.dtype == torch.float32
    assert torch.equal(tg.sequence_logits(hp, params, fns, ids[:100], {}), full[:100])
    assert torch.equal(tg.sequence_logits(hp, params, fns, ids, {}, rows=torch.tensor([149, 3])), full[[149, 3]])


@on_smoke_run
@pytest.mark.parametrize("argv, msg", [
    (["--hellaswag", "{tmp}/nope"], "no checkpoint at"),
    (["--hellaswag", "{ckpt}", "--hellaswag-file", "{tmp}/none.jsonl"], "no HellaSwag file at"),
    (["--sample", "{ckpt}", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["--sample", "{ckpt}", "--num-samples", "0"], "--num-samples: must be >= 1"),
])
def test_command_line_errors_are_one_line(smoke_run, tmp_path, argv, msg, script_main, capsys):
    """``python train_gpt.py ARGV`` as the script's main block, in this process (tests/conftest.py's script_main:
    an exception it let through would fail here as a traceback would in a subprocess): exit code 2, the message
    on the last line of stderr."""
    _, ckpt = smoke_run
    argv = [a.format(tmp=tmp_path, ckpt=ckpt) for a in argv]
    code = script_main(tg, argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert msg in err.strip().splitlines()[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a pass over 10,042 examples with the default model "
                                                          "is GPU work")
def test_full_pass_on_a_default_model_checkpoint_gpu(tmp_path, number_tokenizer, capsys):
    """--hellaswag on a checkpoint of the default model's shape (random weights) and a generated file of
    HellaSwag's size and token counts (10,042 examples, contexts of 20 to 60 tokens, endings of 5 to 25):
    the whole pass runs on one GPU, compiles nothing (evaluation runs the model eagerly, attention included:
    no recompilation storm whatever the lengths) and logs that count; random weights score like random choices
    (25% +- 7 standard deviations of 10,042 draws)."""
    rng = np.random.default_rng(7)
    path = tmp_path / "hellaswag_val.jsonl"
    with open(path, "w") as f:
        for i in range(10_042):
            words = lambda n: " ".join(map(str, rng.integers(0, 50_000, size=n)))
            f.write(json.dumps({"ind": i, "ctx": words(int(rng.integers(20, 61))), "label": int(rng.integers(4)),
                                "endings": [words(int(rng.integers(5, 26))) for _ in range(4)]}) + "\n")
    hp = tg.Hyperparameters()
    ckpt = tmp_path / "ckpt" / "step_000000"
    ckpt.mkdir(parents=True)
    params = tg.init_params(hp, torch.device("cpu"), 0)
    torch.save({"params": {k: v.detach() for k, v in params.items()}, "hyperparameters": tg.dataclasses.asdict(hp),
                "world_size": 1}, ckpt / "rank0.pt")
    res = tg.main(["--hellaswag", str(ckpt), "--hellaswag-file", str(path)])
    out = capsys.readouterr().out
    assert res["examples"] == 10_042 and f"({res['examples']} examples)" in out
    assert re.search(r"^hellaswag_eval: \d+ packs of 4096 tokens on rank 0, [\d.]+ s, \d+ graphs compiled$", out, re.M)
    assert res["compiled_graphs"] == 0, res
    assert 0.25 - 0.03 < res["acc"] < 0.25 + 0.03 and 0.25 - 0.03 < res["acc_norm"] < 0.25 + 0.03, res
