"""Tests of evaluation.py: HellaSwag scoring against a scorer written again here (on logits crafted so the answers
are known), the packing, the rank split, the vocabulary check, and the sampling rule (greedy, temperature,
top-k, seed). End to end on a smoke checkpoint (--hellaswag, --hellaswag-every, --sample): test_hellaswag.py.
"""
import dataclasses
import json
import math
import types

import numpy as np
import pytest
import torch

import evaluation as ev
import train_gpt as tg
from distributed import Dist
from data.hellaswag import HellaSwagError
from flags import SettingsError
from test_hellaswag import NUMBERS, NumberEncoding


# ----------------------------------------------------------------------------------------------------
# Scoring on crafted logits: a "successor" model (token v is likely after v - 1)


def successor_logits(ids, rows, V, boost=6.0):
    """(len(rows), V) logits: boost for the successor of the token at each row, 0 elsewhere."""
    out = torch.zeros(len(rows), V)
    out[torch.arange(len(rows)), (ids[rows].long() + 1) % V] = boost
    return out


def reference_scores(rendered, V, boost=6.0):
    """Float64 log-likelihood sums and token counts of every ending, one candidate at a time (the
    specification written again: log p(t | prev) = boost*[t == prev+1] - log(e^boost + V - 1))."""
    lse = math.log(math.exp(boost) + V - 1)
    sums, counts = [], []
    for ctx, ends, _ in rendered:
        row_s, row_c = [], []
        for end in ends:
            prev = [ctx[-1]] + end[:-1]
            row_s.append(sum(boost * (t == (p + 1) % V) - lse for p, t in zip(prev, end)))
            row_c.append(len(end))
        sums.append(row_s)
        counts.append(row_c)
    return np.array(sums), np.array(counts)


CRAFTED = [
    # (ctx, endings, label): the right ending follows the successor rule throughout
    ([10, 11, 12], [[13, 20], [13, 14], [50, 51], [99]], 1),
    # acc (sum) picks the one-token ending [200]; acc_norm (mean) the long ending with one break: label 0
    ([30], [[31, 32, 33, 34, 35, 36, 37, 38, 39, 77], [200], [300, 301, 5, 9], [400, 7]], 0),
    # a long context and ties: endings 2 and 3 are equal; argmax takes the lower index
    (list(range(100, 140)), [[300], [141, 142], [140, 141], [140, 141]], 2),
]


@pytest.fixture
def crafted():
    """(hp, V, the successor model as evaluation.py takes it, the lengths it was called with)."""
    hp = tg.smoke_hyperparameters()
    V = ev.real_vocab(hp)
    calls = []

    def model(ids, rows):
        assert ids.dtype == torch.int32 and ids.dim() == 1 and ids.numel() % tg.BLOCK == 0
        calls.append(ids.numel())
        return successor_logits(ids.cpu(), rows.cpu(), V)

    return hp, V, model, calls


@pytest.mark.parametrize("pack_tokens", [4096, 40])  # one pack; one example per pack (the 3rd exceeds 40)
def test_scores_match_the_specification(crafted, pack_tokens):
    hp, V, model, calls = crafted
    packs = ev.pack_hellaswag(CRAFTED, hp.bos_id, tg.BLOCK, pack_tokens)
    assert len(packs) == (1 if pack_tokens == 4096 else 3)
    assert len({p.ids.numel() for p in packs}) == 1, "one padded length for all packs"
    total, count = ev.hellaswag_scores(model, packs, len(CRAFTED), torch.device("cpu"))
    ref_s, ref_c = reference_scores(CRAFTED, V)
    np.testing.assert_allclose(total.numpy(), ref_s, rtol=1e-6, atol=1e-5)
    assert np.array_equal(count.numpy(), ref_c)
    acc, acc_norm = ev.hellaswag_predictions(total, count)
    assert acc.tolist() == ref_s.argmax(1).tolist() == [1, 1, 2]
    assert acc_norm.tolist() == (ref_s / ref_c).argmax(1).tolist() == [1, 0, 2]
    assert len(calls) == len(packs)


def test_pack_layout():
    """Every candidate is [BOS] + ctx + ending; each row predicts the token after it."""
    packs = ev.pack_hellaswag(CRAFTED, 511, tg.BLOCK, 4096)
    ids = packs[0].ids.tolist()
    used = sum(1 + len(ctx) + len(e) for ctx, ends, _ in CRAFTED for e in ends)
    assert len(ids) == 256 and used > 128 and set(ids[used:]) == {511}
    assert ids[:14] == [511, 10, 11, 12, 13, 20, 511, 10, 11, 12, 13, 14, 511, 10]
    p = packs[0]
    assert torch.equal(p.targets, p.ids[p.rows + 1].long())
    assert p.cands.tolist()[:4] == [0, 0, 1, 1]


def test_rank_split_and_counts(crafted, tmp_path, monkeypatch):
    """Two ranks take examples 0, 2, ... and 1, 3, ...; their counts add up to the one-rank counts."""
    hp, V, model, _ = crafted
    lines = []
    for ctx, ends, label in CRAFTED * 3:
        lines.append(json.dumps({"ctx": " ".join(map(str, ctx)), "label": label,
                                 "endings": [" ".join(map(str, e)) for e in ends]}))
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(lines) + "\n")
    hp = dataclasses.replace(hp, hellaswag_file=str(f))
    reduced = []
    monkeypatch.setattr(tg.dist, "all_reduce", lambda t: reduced.append(t.clone()))
    one = ev.HellaSwag(hp, Dist(), tg.BLOCK, NumberEncoding()).evaluate(model)
    assert one == {"acc": 6 / 9, "acc_norm": 1.0, "examples": 9}  # acc misses example 2 (sum vs mean)
    for r in range(2):
        h = ev.HellaSwag(hp, Dist(rank=r, world=2), tg.BLOCK, NumberEncoding())
        assert h.labels.tolist() == [lab for _, _, lab in (CRAFTED * 3)[r::2]]
        h.evaluate(model)
    assert (reduced[0] + reduced[1]).tolist() == [9, 6, 9]


def test_tokens_beyond_the_vocabulary_are_refused(tmp_path):
    """GPT-2 text on the smoke model (512 ids): refused with a message, never an index error."""
    hp = tg.smoke_hyperparameters(hellaswag_file=str(NUMBERS))
    (tmp_path / "n.jsonl").write_text(NUMBERS.read_text().replace('"17 25', '"512 25'))
    ev.HellaSwag(hp, Dist(), tg.BLOCK, NumberEncoding())  # ids up to 510: accepted
    hp = tg.smoke_hyperparameters(hellaswag_file=str(tmp_path / "n.jsonl"))
    with pytest.raises(HellaSwagError, match="tokens reach id 512, beyond the model's vocabulary of 512 ids"):
        ev.HellaSwag(hp, Dist(), tg.BLOCK, NumberEncoding())


def test_real_vocab():
    assert ev.real_vocab(tg.Hyperparameters()) == 50257 and ev.real_vocab(tg.smoke_hyperparameters()) == 512


# ----------------------------------------------------------------------------------------------------
# Sampling rule


def test_next_token_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=g) * 3
    logits[17] = logits[250] = logits.max() + 1  # a tie for the maximum: the lower id wins
    for t in (0.0, 0.5, 1.0, 7.0):
        assert ev.next_token(logits, t, 1, g) == 17
    assert ev.next_token(logits, 0.0, 0, g) == 17 == int(torch.argmax(logits))
    # top-k: draws stay in the k largest; frequencies follow softmax(l / t) over them
    k, t, n = 5, 2.0, 4000
    top = torch.argsort(logits.double(), descending=True, stable=True)[:k]
    draws = torch.tensor([ev.next_token(logits, t, k, torch.Generator().manual_seed(i)) for i in range(n)])
    assert set(draws.tolist()) <= set(top.tolist())
    p = torch.softmax(logits.double()[top] / t, 0)
    freq = torch.stack([(draws == i).double().mean() for i in top])
    # binomial std of a frequency is sqrt(p(1-p)/n) <= 0.008; 5 std is never reached by chance
    assert (freq - p).abs().max() < 5 * 0.008, (freq, p)
    # the generator decides: same seed, same draw sequence
    a = [ev.next_token(logits, 1.0, 0, g1) for g1 in [torch.Generator().manual_seed(3)] * 20]
    b = [ev.next_token(logits, 1.0, 0, g1) for g1 in [torch.Generator().manual_seed(3)] * 20]
    assert a == b and len(set(a)) > 1


def _sample_with(monkeypatch, train_files, vocab, prompt, gpt2=None, best=33):
    """evaluation.sample on a stand-in checkpoint (train_files, vocab; BOS 256) whose model always prefers id best
    (33: the byte of "!"), greedily, three new tokens. gpt2: what load_gpt2 returns (None: calling it fails the test).
    Returns (the printed texts, the id list the model saw first)."""
    hp = dataclasses.replace(tg.Hyperparameters(), train_files=train_files, vocab_size=vocab, bos_id=256)
    seen = []

    def logits(x, rows):
        seen.append(x.tolist())
        out = torch.zeros(len(rows), vocab)
        out[:, best] = 1.0
        return out

    def no_gpt2():
        raise AssertionError("the byte corpus needs no GPT-2 tokenizer")

    monkeypatch.setattr(ev, "load_gpt2", (lambda: gpt2) if gpt2 is not None else no_gpt2)
    args = types.SimpleNamespace(sample="ckpt", prompt=prompt, seed=0, num_samples=1, max_new_tokens=3,
                                 temperature=0.0, top_k=0)
    texts = ev.sample(args, Dist(), lambda path, d: (hp, None, None), lambda hp, params, fns, cache: logits)
    return texts, seen[0]


def test_sampling_a_smoke_corpus_checkpoint_reads_and_writes_bytes(monkeypatch):
    """A checkpoint trained on --smoke's byte corpus (its --train-files glob, data/smoke_corpus.py): the prompt's
    UTF-8 bytes after BOS, the output decoded as bytes (BOS and non-byte ids dropped), no GPT-2 files needed."""
    texts, first = _sample_with(monkeypatch, "data/smoke/smoke_train_*.bin", 384, "héllo")
    assert first == [256, 104, 195, 169, 108, 108, 111]  # "é" is two UTF-8 bytes
    assert texts == ["héllo!!!"]
    assert _sample_with(monkeypatch, "data/smoke/smoke_train_*.bin", 384, "héllo", best=300)[0] == ["héllo"]


def test_sampling_other_checkpoints_uses_gpt2_and_refuses_ids_beyond_the_vocabulary(monkeypatch):
    """Any other corpus is GPT-2 tokens; a prompt token the checkpoint's vocabulary lacks is one line naming
    --prompt (not an index error inside the model)."""
    enc = types.SimpleNamespace(encode_ordinary=lambda text: [int(t) for t in text.split()],
                                decode=lambda ids: " ".join(map(str, ids)))
    texts, first = _sample_with(monkeypatch, "data/mine/fineweb_train_*.bin", 384, "7 300", gpt2=enc)
    assert first == [256, 7, 300] and texts == ["7 300 33 33 33"]
    with pytest.raises(SettingsError, match=r"^--prompt: its tokens reach id 384, beyond the vocabulary of 384 "):
        _sample_with(monkeypatch, "data/mine/fineweb_train_*.bin", 384, "7 384", gpt2=enc)
    with pytest.raises(SettingsError, match=r"of ckpt \(trained on data/mine/fineweb_train_\*\.bin: "):
        _sample_with(monkeypatch, "data/mine/fineweb_train_*.bin", 384, "9999", gpt2=enc)
