"""HellaSwag accuracy and sampling for train_gpt.py (--hellaswag, --hellaswag-every, --sample).

The model comes in as a function ``logits(ids, rows)``: the next-token logits (len(rows), V) fp32 of one 1-D
int32 id sequence on the device (one or more documents, each starting with BOS), at the positions ``rows``, V
the real vocabulary (``real_vocab``). train_gpt.py passes its ``sequence_logits`` with the model bound
(``model_logits``), and for a checkpoint (``evaluate_hellaswag``, ``sample``: the --hellaswag and --sample modes)
its ``load_model`` too; so this module imports nothing from the trainer.

HellaSwag: every ending is scored as a document [BOS] + context + ending (the ending with a leading space,
data/hellaswag.py's ``render``); the examples of a rank are packed into sequences of up to
HELLASWAG_PACK_TOKENS tokens (``pack_hellaswag``: documents never attend to each other, so a pack scores like
its candidates one at a time); ``acc`` picks the ending with the highest summed log-likelihood, ``acc_norm``
the highest mean per ending token. Sampling: ``generate`` draws one token at a time with ``next_token``.
"""
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from compilation import unique_graphs
from data.hellaswag import HellaSwagError, load_examples, render
from data.prepare_text import load_gpt2
from data.smoke_corpus import ByteCodec, is_smoke_corpus
from flags import SettingsError

GPT2_VOCAB = 50257  # ids >= this are vocabulary padding: never scored or sampled
HELLASWAG_PACK_TOKENS = 4096  # examples are packed into sequences of up to this many tokens (one shape)


def real_vocab(hp):
    """Ids a model can emit: GPT-2's 50257, or the whole (smaller) vocabulary of a test model."""
    return min(hp.vocab_size, GPT2_VOCAB)


@dataclass
class EvalPack:
    """Several HellaSwag examples as one sequence: every candidate is a document [BOS] + context + ending."""
    ids: torch.Tensor  # (T,) int32, padded with BOS to the common length
    rows: torch.Tensor  # (R,) int64 positions whose logits predict an ending token
    targets: torch.Tensor  # (R,) int64 the ending token each row predicts
    cands: torch.Tensor  # (R,) int64 candidate of each row: 4 * (example index in the rank's list) + ending


def pack_hellaswag(rendered, bos_id, block, pack_tokens=HELLASWAG_PACK_TOKENS):
    """Pack rendered examples [(ctx ids, [4 ending ids], label)] greedily, whole examples only, into
    sequences of at most pack_tokens (an example longer than that gets a sequence of its own), all padded
    with BOS to one length, a multiple of ``block`` (the model's: then every pack is one shape)."""
    packs, cur = [], None
    for e, (ctx, endings, _) in enumerate(rendered):
        size = sum(1 + len(ctx) + len(end) for end in endings)
        if cur is None or (cur[0] and len(cur[0]) + size > pack_tokens):
            cur = ([], [], [], [])
            packs.append(cur)
        ids, rows, targets, cands = cur
        for j, end in enumerate(endings):
            start = len(ids) + 1 + len(ctx)  # position of the ending's first token
            ids += [bos_id, *ctx, *end]
            rows += range(start - 1, start - 1 + len(end))
            targets += end
            cands += [4 * e + j] * len(end)
    T = max((-(-len(p[0]) // block) * block for p in packs), default=block)
    return [EvalPack(torch.tensor(ids + [bos_id] * (T - len(ids)), dtype=torch.int32), torch.tensor(rows),
                     torch.tensor(targets), torch.tensor(cands)) for ids, rows, targets, cands in packs]


def hellaswag_scores(logits, packs, n_examples, device):
    """(sum, count), float64 (n_examples, 4): per ending, its log-likelihood sum_j log p(e_j | ctx, e_<j)
    (fp32 log-softmax of the model's ``logits``, summed in float64) and its number of tokens."""
    total = torch.zeros(4 * n_examples, dtype=torch.float64, device=device)
    count = torch.zeros(4 * n_examples, dtype=torch.float64, device=device)
    for p in packs:
        rows, targets, cands = (t.to(device) for t in (p.rows, p.targets, p.cands))
        logp = logits(p.ids.to(device), rows).log_softmax(-1)
        total.index_add_(0, cands, logp.gather(1, targets[:, None])[:, 0].double())
        count.index_add_(0, cands, torch.ones(len(cands), dtype=torch.float64, device=device))
    return total.view(-1, 4), count.view(-1, 4)


def hellaswag_predictions(total, count):
    """(acc, acc_norm) predicted ending per example. acc: argmax of the summed log-likelihood. acc_norm:
    argmax of the mean per-token log-likelihood (sum / number of ending tokens), the convention of
    build-nanogpt's HellaSwag evaluation (lm-eval-harness divides by the ending's bytes instead). Ties go
    to the lowest index."""
    return total.argmax(1), (total / count).argmax(1)


class HellaSwag:
    """This rank's share of the examples (r, r + W, ...) of hp.hellaswag_file (the first hp.hellaswag_limit, 0:
    all), rendered and packed once for a model of hp's vocabulary and BOS and of block ``block``; ``evaluate``
    scores them and all-reduces the counts: (examples, correct acc, correct acc_norm) over all ranks. d: the
    run's ranks and device (distributed.Dist)."""

    def __init__(self, hp, d, block, encoding=None):
        examples = load_examples(hp.hellaswag_file, hp.hellaswag_limit)
        enc = encoding or load_gpt2()  # tests pass a stand-in tokenizer
        rendered = [render(ex, enc.encode_ordinary) for ex in examples[d.rank::d.world]]
        top = max((max(ctx + sum(ends, [])) for ctx, ends, _ in rendered), default=0)
        if top >= real_vocab(hp):
            raise HellaSwagError(f"{hp.hellaswag_file}: the tokens reach id {top}, beyond the model's "
                                 f"vocabulary of {real_vocab(hp)} ids")
        self.labels = torch.tensor([label for _, _, label in rendered], dtype=torch.int64)
        self.packs = pack_hellaswag(rendered, hp.bos_id, block)
        self.d = d

    def evaluate(self, logits):
        """{"acc", "acc_norm", "examples"} over all ranks of the model ``logits``."""
        labels = self.labels.to(self.d.device)
        pred, pred_norm = hellaswag_predictions(*hellaswag_scores(logits, self.packs, len(labels), self.d.device))
        counts = torch.stack([torch.tensor(len(labels), device=self.d.device), (pred == labels).sum(),
                              (pred_norm == labels).sum()]).to(torch.int64)
        if self.d.world > 1:
            dist.all_reduce(counts)
        n_all, acc, acc_norm = counts.tolist()
        return {"acc": acc / max(n_all, 1), "acc_norm": acc_norm / max(n_all, 1), "examples": n_all}


def next_token(logits, temperature, top_k, generator):
    """One token id from (V,) logits: argmax when temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest logits (0: all), using ``generator``
    (a CPU torch.Generator: the draw is the same on every device). Ties rank the lower id first, so top_k=1
    is the argmax."""
    logits = logits.detach().double().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    order = torch.argsort(logits, descending=True, stable=True)
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(logits[keep] / temperature, 0)
    return int(keep[torch.multinomial(probs, 1, generator=generator)])


def generate(logits, prompt, max_new_tokens, temperature, top_k, generator, device):
    """The id list ``prompt`` continued by max_new_tokens ids, each drawn by next_token from the model's
    ``logits`` at the last position (the whole sequence is read again for every token: no cache)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        x = torch.tensor(ids, dtype=torch.int32, device=device)
        ids.append(next_token(logits(x, [len(ids) - 1])[0], temperature, top_k, generator))
    return ids


def write_new_result(folder, stem, text):
    """Write ``text`` to folder/STEM_N.json, N the smallest >= 1 whose file does not exist, and return its path.
    The file is created exclusively: an earlier result is never overwritten, two evaluations never share a file."""
    for n in itertools.count(1):
        path = Path(folder) / f"{stem}_{n}.json"
        try:
            with open(path, "x") as f:
                f.write(text)
            return path
        except FileExistsError:
            continue


def evaluate_hellaswag(args, d, load_model, model_logits, block):
    """--hellaswag CHECKPOINT (args.hellaswag; args.hellaswag_file / hellaswag_limit override the checkpoint's):
    the accuracy of the checkpoint's model, printed and written to a new file in the checkpoint folder
    (write_new_result: hellaswag_1.json, hellaswag_2.json, ...; an earlier result is never overwritten), whose path
    is printed too. load_model(path, d) -> (hp, params, fns) and model_logits(hp, params, fns, rot_cache) ->
    logits: train_gpt.py's; block: its window unit (the packs' length is a multiple of it)."""
    hp, params, fns = load_model(args.hellaswag, d)
    over = {k: getattr(args, k) for k in ("hellaswag_file", "hellaswag_limit") if getattr(args, k) is not None}
    hp = dataclasses.replace(hp, **over)
    bench = HellaSwag(hp, d, block)
    graphs, t0 = unique_graphs(), time.perf_counter()
    res = bench.evaluate(model_logits(hp, params, fns, {}))
    res |= {"file": str(hp.hellaswag_file), "limit": hp.hellaswag_limit, "world_size": d.world,
            "scoring": "acc: summed ending log-likelihood; acc_norm: mean per ending token",
            "packs": len(bench.packs), "seconds": round(time.perf_counter() - t0, 1),
            "compiled_graphs": unique_graphs() - graphs}
    if d.rank == 0:
        print(f"hellaswag acc: {res['acc']:.4f} acc_norm: {res['acc_norm']:.4f} ({res['examples']} examples)")
        print(f"hellaswag_eval: {res['packs']} packs of {bench.packs[0].ids.numel() if bench.packs else 0} tokens "
              f"on rank 0, {res['seconds']} s, {res['compiled_graphs']} graphs compiled")
        path = write_new_result(args.hellaswag, "hellaswag", json.dumps(res, indent=1) + "\n")
        print(f"hellaswag_result: {path}")
    return res


def sample(args, d, load_model, model_logits):
    """--sample CHECKPOINT: print --num-samples continuations of --prompt (one after another, each its own
    sequence), drawn with --temperature / --top-k from a generator seeded with --seed. load_model and
    model_logits: as for evaluate_hellaswag. The text is GPT-2 tokens, or the bytes of --smoke's own corpus for a
    checkpoint trained on it (data/smoke_corpus.py); a prompt token beyond the checkpoint's vocabulary (a model
    trained on other ids) is refused in one line."""
    hp, params, fns = load_model(args.sample, d)
    enc = ByteCodec() if is_smoke_corpus(hp.train_files) else load_gpt2()
    prompt = [hp.bos_id] + enc.encode_ordinary(args.prompt)
    if max(prompt) >= hp.vocab_size:
        raise SettingsError(f"--prompt: its tokens reach id {max(prompt)}, beyond the vocabulary of {hp.vocab_size} "
                            f"ids of {args.sample} (trained on {hp.train_files}: other token ids than GPT-2's)")
    g = torch.Generator().manual_seed(0 if args.seed is None else args.seed)
    model, texts, graphs = model_logits(hp, params, fns, {}), [], unique_graphs()
    for i in range(args.num_samples):
        ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, g, d.device)
        texts.append(enc.decode(ids[1:]))
        if d.rank == 0:
            print(texts[-1] if args.num_samples == 1 else f"--- sample {i + 1}/{args.num_samples}\n{texts[-1]}")
    if d.rank == 0:  # on stderr: stdout is the text
        print(f"sample_eval: {unique_graphs() - graphs} graphs compiled (the model runs eagerly)",
              file=sys.stderr)
    return texts
