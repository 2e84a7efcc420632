"""GPT-2 (124M class) speedrun trainer: one flat file, no nn.Module tree.

Run:  torchrun --standalone --nproc_per_node=8 train_gpt.py      (world size 1, 2, 4 or 8)
      python train_gpt.py --smoke      (tiny CPU run; without shards it trains on this repository's text)
      python train_gpt.py --sample checkpoints/<run>/step_001385 --prompt "The" --temperature 0.8 --top-k 50
      python train_gpt.py --hellaswag checkpoints/<run>/step_001385    (data: python data/hellaswag.py)
Every field of `Hyperparameters` is a flag (`--adam-lr 0.01`, `--no-compile`, a tuple as a comma list:
`--long-window-layers 3,10`); `--help` lists them with their comments. The stage table (`STAGES`) is edited here.

This file holds what a record changes, in sections: hyperparameters, the schedule (the stage table and the
functions of the step), the parameter table (PARAMS) and init, the model, the optimizer, the data order, the
training loop and its log lines. The machinery around a run lives in modules beside it, which import nothing from
it: cli.py (flags, settings' checks, one-line errors, Ctrl-C), checkpoints.py (saves, --resume checks), run_log.py
(shards, log, step clock), compilation.py (compile warmup report, --compile-cache), profiling.py, evaluation.py
(HellaSwag, sampling), distributed.py (processes, collectives) and flags.py; kernels/ holds the Triton kernels
and the attention op, data/ the shard format, the corpora and the batches' way to the device (data/loader.py).

Model: record #74's (README.md: its features and where we deviate) with four ideas of later public records, a
straight-line forward over parameter banks (make_layers): 11 layers of width 768 with 6 heads of 128, rotary,
QK-norm, ReLU^2 MLP, value embeddings, a U-net skip, a bigram hash embedding, paired-head attention, multi-token
prediction, smear, YaRN, key offset, backout, and an LM head stored transposed (768 x 50304), tied to the token
embedding until untie_step; one residual stream (--one-stream, public record #77's; record #74 has two lanes from
layer 7) with record #81's per-token dense connections into the last two layers (--mudd: mudd_layer), a learnable
XSA (--xsa, the idea of record #82: xsa_part) in the unpaired attention layers, and in the optimizer record #80's
Muon per pair of heads of W_q and W_k (--muon-qk-pairs: Group). The schedule is record #82's: 1375 steps in three
stages, then 10 at the final lr. Each feature is a bool flag, on by default (`--no-bigram`, `--no-xsa`, ...):
`--no-one-stream --no-mudd --no-xsa --no-muon-qk-pairs --steps 1450 --extension-steps 40` is record #74's
configuration (the smoke config keeps its layout). Opt-in: --prefix-loss, record #88's prefix-token loss
(prefix_token_table).

Compilation (CUDA): the embedding lookups run eagerly (gathers whose deterministic backward kernels, kernels/
embedding.py, run after the compiled backward); everything else, the layers and the head with its loss, is one
`torch.compile(fullgraph=True, dynamic=False)` region per micro-batch length (train_step; val_step). What changes
between steps without changing shapes is a tensor argument: the multi-token weights, the rotary tables and
softmax scale, the windows, the document boundaries (a dynamic dimension). With --dynamic-tokens (opt-in) the
micro-batch length and the documents' length bound are dynamic sizes too: one training graph for every stage
(model_inputs marks them). Attention (kernels/attention.py:
FlashAttention's varlen kernels), the FP8 head with its loss and the fused MLP (kernels/mlp.py) are custom ops in
the region; the fused MLP's are Triton ops, whose kernels AOT autograd traces into it as user-defined Triton kernels.
While the compile warmup compiles its first training graph, second processes compile the others (the other
micro-batch lengths, on a GPU of 120 GiB or more) and the validation step into the same caches (compile_ahead), and
the warmup then loads them.

Optimizer (eager; our Triton kernels): gradients accumulate in fp32, are reduce-scattered along dim 0 (each
group's in the last micro-step's backward as soon as it is complete, as the step's plan says: step_plan), then per
shard NorMuon updates the two banks and fused AdamW (fp32 masters, cautious decay) the rest, and the shards are
all-gathered. Adam rows step every adam_every steps and at the last, on the gradients summed since their last step.
Batch: 8 BOS-aligned micro-batches ("slots") per step; rank r of W takes slots r, r+W, ..., so every world size
computes the same step up to fp32 summation order. CPU: the kernels' PyTorch references, dense attention, eager.
"""
import dataclasses
import gc
import hashlib
import json
import math
import os
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

if not torch.cuda.is_available():
    # The kernels must see TRITON_INTERPRET before their @triton.jit functions are defined, i.e. before import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist
import torch.nn.functional as F

from checkpoints import (ADDED_PARAMS, load_checkpoint, read_checkpoint, save_checkpoint, saved_hyperparameters,
                         tidy_checkpoints)
from cli import check_settings, one_line_errors, open_run, parse_args, run_outcome, set_up_process
from compilation import (Compilation, CompileCache, Precompiled, ahead_report, compile_metrics, compile_report,
                         cpp_wrapper_options)
from data.loader import BackgroundLoader, MicroBatch
from data.prepare_text import load_gpt2
from data.shards import ShardError, load_shard
from distributed import Dist, all_gather_rows, end_with_the_parent, reduce_scatter_sum, setup_distributed
from evaluation import HellaSwag, evaluate_hellaswag, hellaswag_scores, real_vocab, sample
from flags import SettingsError
from kernels.attention import DocSeq, dense_attend, doc_cu_seqlens, doc_ids, flash_attend
from kernels.cross_entropy import (FP8_GRAD_S, FP8_W_S, FP8_X_S, fp8_e4m3, fp8_head_ce, fp8_head_ce_grad_in_fwd,
                                   fp8_head_support, fp8_head_weights, head_ce_grad_in_fwd,
                                   softcapped_cross_entropy, softcapped_cross_entropy_ref)
from kernels.dispatch import StepKernels
from kernels.embedding import cpu_embedding, embedding, prepare_ids
from kernels.mlp import register_ops as register_mlp_ops, relu2_mlp
from profiling import profile_stages
from run_log import StartupClock, StepClock, dir_bytes, launch_phases, log_summary, path_lines

SLOTS = 8  # micro-batches per global batch; the 8-GPU layout every world size reproduces
BLOCK = 128  # window sizes are counted in blocks of this many tokens (and micro-batches are multiples of it)

# -----------------------------------------------------------------------------
# Hyperparameters (every field is a command-line flag, cli.parse_args; the schedule table is below)


@dataclass
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # glob of validation shards (the first is used)
    val_tokens: int = 10_485_760  # validation tokens (fewer if the val shard is smaller; rounded to micro-batches)
    val_micro_tokens: int = 262_144  # tokens per validation micro-batch: a contiguous chunk, its own compiled graph
    bos_id: int = 50256  # GPT-2 <|endoftext|>, which starts every document
    vocab_from_data: bool = False  # vocab_size := max id in the shards + 1 rounded up to 128; bos_id := their first id
    # model
    vocab_size: int = 50304  # embedding rows: GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 11  # transformer blocks
    model_dim: int = 768  # residual width C
    num_heads: int = 6  # attention heads (num_heads * head_dim must equal model_dim)
    head_dim: int = 128  # dimensions per attention head
    mlp_dim: int = 3072  # MLP hidden width
    no_attn_layers: tuple = (6,)  # layers without attention (public record: dropping layer 6's is free)
    ve_tables: tuple = (-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4)  # value-embedding table per layer, -1 = none
    long_window_layers: tuple = (3, 10)  # layers using the long window; the others use the short one
    skip_from: int = 3  # U-net skip source: lane 0 after this layer's attention is saved ...
    skip_to: int = 6  # ... and added (gated) before this layer (U-net skip target)
    parallel_start: int = 7  # first layer with two residual lanes (attention reads lane 0, MLP lane 1)
    gate_dims: int = 12  # attention / value-embedding / smear / skip gates read this many leading dims
    attn_scale: float = 0.1  # softmax scale (QK-normed heads need a larger-than-1/sqrt(d) temperature)
    softcap: float = 23.0  # logits -> softcap * sigmoid((logits + 5) / 7.5)
    # model features (record #74 parity; each bool is on by default, --no-<name> turns it off)
    bigram: bool = True  # add a hashed (previous token, token) embedding to the residual stream
    bigram_vocab_size: int = 5 * 50304  # rows of the bigram table (the last is reserved: position 0 and each BOS)
    paired_heads: bool = True  # paired-head attention in paired_head_layers
    paired_head_layers: tuple = (0, 2, 5, 9)  # layers where head h and head h + H/2 attend as one interleaved head
    mtp: bool = True  # multi-token prediction loss with the stage table's weights (off: next token only)
    smear: bool = True  # gated smear of the previous token's embedding into each position
    yarn: bool = True  # YaRN: rescale rotary frequencies and grow the softmax scale when the long window grows
    key_offset: bool = True  # long-window layers' keys take their position-free dims from the previous token
    backout: bool = True  # subtract backout_lambda * (lane 0 after backout_layer) before the LM head
    backout_layer: int = 7  # the layer whose output (lane 0) is backed out
    fp8_head: bool = True  # FP8 LM-head matmuls in training (CUDA capability >= 8.9; bf16 otherwise)
    attn_lambdas: bool = True  # per-layer scalars pre-multiplying W_qkv and W_o (init 0.5 and 1.0)
    # model features of later public records (on by default; --no-<name> each for record #74's model)
    xsa: bool = True  # record #82's learnable XSA: unpaired heads drop tanh(xsa_alpha) of their output's own-v part
    one_stream: bool = True  # record #77: one lane; attention after backout_layer reads its output; skip after MLP
    mudd: bool = True  # record #81 (needs --one-stream): per-token MLPs mix earlier states into the last two layers
    # opt-in model feature (beyond record #74; off by default)
    prefix_loss: bool = False  # record #88: also score each position on its target's prefix token (Stage.prefix)
    # schedule (record #82's; record #74's: --steps 1450 --extension-steps 40)
    scheduled_steps: int = 1375  # steps of the staged lr / batch / window schedule
    extension_steps: int = 10  # steps after the scheduled ones, at the final lr with the longest windows
    cooldown_frac: float = 0.6  # last fraction of scheduled steps where lr decays linearly to cooldown_floor
    cooldown_floor: float = 0.15  # lr multiplier at the end of the cooldown
    untie_stage: int = 2  # embedding and LM head are untied after the first slow Adam step of this stage
    final_long_window: int = 20  # long window (blocks) of the final validation; rotary/YaRN stay the last stage's
    # Muon (NorMuon) for attn_bank / mlp_bank
    muon_lr: float = 0.023  # Muon learning rate (before the schedule's lr factor)
    muon_momentum_min: float = 0.85  # momentum at the start and the end (warmup to max, cooldown back to min)
    muon_momentum_max: float = 0.95  # momentum between the warmup and the cooldown
    muon_warmup_steps: int = 300  # steps of the momentum warmup
    muon_cooldown_steps: int = 50  # last steps, where the momentum goes back from max to min
    muon_beta2: float = 0.95  # NorMuon second-moment decay
    muon_qk_pairs: bool = True  # record #80: Muon takes each pair of heads' rows of W_q, W_k as a matrix of its own
    muon_wd: float = 1.2  # cautious decay per step = muon_wd * lr_sched * lr_effective
    mlp_proj_lr_mul: float = 2.0  # extra lr for W_proj^T (odd matrices of mlp_bank), as in the public record
    # Adam for embeddings, head, gates, scalars
    adam_lr: float = 0.008  # AdamW learning rate (before the schedule's lr factor)
    adam_eps: float = 1e-10  # AdamW epsilon added to sqrt(v)
    adam_wd: float = 0.005  # decoupled decay per step = adam_wd * wd_mul * lr_effective^2 (public convention)
    # optimizer / profiling
    adam_every: int = 2  # Adam parameters (PARAMS' slow rows) step every N steps on the N summed grads
    profile_steps: int = 0  # profile N untimed steps per stage start: trace, kernel table, CUDA launch_probe lines
    # CUDA; the same bits as --no-embed-grad-to-acc (dense gradients, folded into the accumulators by the hooks)
    embed_grad_to_acc: bool = True  # embedding backward adds touched rows into the optimizer's fp32 accumulators
    # run
    seed: int = 0  # parameter init (the data order is fixed: the shards are read in order)
    val_every: int = 250  # steps between validations (0: only at the end)
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    log_train_loss: bool = False  # add train_loss to step lines (read when the step is seen done: no extra sync)
    hellaswag_every: int = 0  # steps between HellaSwag evaluations in training, clock stopped (0: none)
    hellaswag_file: str = "data/hellaswag/hellaswag_val.jsonl"  # HellaSwag jsonl (python data/hellaswag.py)
    hellaswag_limit: int = 0  # evaluate only the first N HellaSwag examples (0: all)
    compile: bool = True  # torch.compile the model functions (always off on the CPU)
    compile_ahead: bool = True  # while compiling, second processes compile the other graphs (ahead_graphs)
    # opt-in: extra inductor options (outside the public rules); the same kernels and bits, a longer cold compile
    cpp_wrapper: bool = False  # the compiled training step launches its kernels from C++ (inductor's cpp_wrapper)
    # opt-in: no compile option (torch._dynamo.mark_dynamic on the step's inputs); the same math, one graph to compile
    dynamic_tokens: bool = False  # one compiled training step for every micro-batch length (T a dynamic size)
    # CUDA, bf16 matrices (kernels/mlp.py): traced into the compiled step as user-defined Triton kernels
    fused_mlp: bool = True  # MLP up-projection with its ReLU² (and, backward, its derivative) in one Triton matmul
    # opt-in (record #87): the fused MLP saves act alone, ReLU' from sqrt(act): no pre written; other bits of dpre
    mlp_act_only: bool = False  # fused MLP saves act only; relu(pre) = rnd(sqrt(act)) (exact where act is normal)
    ce_grad_in_forward: bool = False  # CUDA: the head's CE forward kernel also writes the logits' gradient (opt-in)
    param_dtype: str = "bfloat16"  # dtype of the matrices (tests use float32 to isolate accumulation error)
    # The Stage table (schedule section below); not a command-line flag: a table is edited in the code.
    stages: tuple = dataclasses.field(default_factory=lambda: STAGES)  # batch / window / lr stages

    @property
    def total_steps(self):
        return self.scheduled_steps + self.extension_steps

    @property
    def attn_layers(self):
        return [i for i in range(self.num_layers) if i not in self.no_attn_layers]

    @property
    def num_ve(self):
        return max(self.ve_tables) + 1

    @property
    def paired_layers(self):
        return set(self.paired_head_layers) if self.paired_heads else set()

    @property
    def xsa_layers(self):
        """The layers XSA acts on (none without --xsa): the attention layers without paired heads. There head h's
        output at token t has one value vector of its own, v[t, h]; a paired head attends to the values of two heads
        at each token (the interleaved 2T sequence), so no single v lines up with its output."""
        return [i for i in self.attn_layers if i not in self.paired_layers] if self.xsa else []


def smoke_hyperparameters(**overrides):
    """Tiny model and schedule for the CPU smoke run, with record #74's layout (two lanes, no XSA, MUDD or Muon
    Q/K pairs: each flag turns its feature on). The vocabulary and BOS come from the shards (see
    cli.fit_to_data): 512 and 511 for the tests' small-id shards, 50304 and 50256 for GPT-2 shards."""
    hp = Hyperparameters(
        val_tokens=8 * 256 * 2, val_micro_tokens=256, bos_id=511, vocab_size=512,
        num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_dim=256, no_attn_layers=(),
        ve_tables=(0, -1, -1, 0), long_window_layers=(1, 3), skip_from=1, skip_to=2, parallel_start=2,
        scheduled_steps=8, extension_steps=2, muon_warmup_steps=4, muon_cooldown_steps=2, untie_stage=1,
        final_long_window=2,
        val_every=4, log_train_loss=True, compile=False, stages=SMOKE_STAGES, adam_lr=0.02, vocab_from_data=True,
        bigram_vocab_size=256, paired_head_layers=(0, 2), backout_layer=2,
        one_stream=False, mudd=False, xsa=False, muon_qk_pairs=False,  # record #74's layout (the tests' model)
        adam_every=1)  # 10 steps are too few to learn the rule with half as many embedding updates
    return dataclasses.replace(hp, **overrides)


# -----------------------------------------------------------------------------
# Schedule: the stage table and every function of the step number (lr, momentum, untie, windows, batch)


@dataclass(frozen=True)
class Stage:
    end_frac: float | None  # stage ends at this fraction of the scheduled steps; None = the extension stage
    batch_tokens: int  # global tokens per step (SLOTS micro-batches of batch_tokens // SLOTS)
    windows: tuple  # (short, long) attention windows, in BLOCK-token blocks
    lr_mul: float  # learning-rate multiplier before the cooldown (grows with the batch: ~ (B/B0)^0.5..0.6)
    max_doc_len: int  # a document is cut to this many tokens in a training micro-batch (the rest is dropped)
    mtp_start: tuple = (1.0,)  # multi-token prediction weights w_0.. at the stage's first step ...
    mtp_end: tuple = (1.0,)  # ... and at its end (linear in between, as in the public record)
    prefix: tuple = (0.0, 0.0)  # --prefix-loss: the prefix-token term's weight at the stage's start and end (linear)


# The public record's three batch-size stages plus a short extension at the final learning rate; its
# multi-token prediction weights [1, .5, .25 -> 0] -> [1, .5 -> 0] -> [1]; documents cut to 896 tokens in the
# first stage (short windows: more, shorter documents per batch), 2048 after. --prefix-loss (record #88's
# weights): .25 -> .25 -> 0, then 0.
STAGES = (
    Stage(end_frac=1 / 3, batch_tokens=8 * 2048 * 8, windows=(1, 3), lr_mul=1.0, max_doc_len=896,
          mtp_start=(1.0, 0.5, 0.25), mtp_end=(1.0, 0.5, 0.0), prefix=(0.25, 0.25)),
    Stage(end_frac=2 / 3, batch_tokens=16 * 2048 * 8, windows=(3, 7), lr_mul=1.52, max_doc_len=2048,
          mtp_start=(1.0, 0.5), mtp_end=(1.0, 0.0), prefix=(0.25, 0.0)),
    Stage(end_frac=1.0, batch_tokens=24 * 2048 * 8, windows=(5, 11), lr_mul=1.73, max_doc_len=2048),
    Stage(end_frac=None, batch_tokens=24 * 2048 * 8, windows=(6, 13), lr_mul=1.0, max_doc_len=2048),
)
SMOKE_STAGES = (
    Stage(end_frac=1 / 2, batch_tokens=8 * 128, windows=(1, 1), lr_mul=1.0, max_doc_len=96,
          mtp_start=(1.0, 0.5, 0.25), mtp_end=(1.0, 0.5, 0.0), prefix=(0.25, 0.25)),
    Stage(end_frac=1.0, batch_tokens=8 * 256, windows=(1, 2), lr_mul=1.2, max_doc_len=192,
          mtp_start=(1.0, 0.5), mtp_end=(1.0, 0.0), prefix=(0.25, 0.0)),
    Stage(end_frac=None, batch_tokens=8 * 256, windows=(2, 2), lr_mul=1.0, max_doc_len=192),
)


def stage_bounds(hp):
    """[(start, end, Stage)] covering steps 0 .. total_steps - 1."""
    bounds, start = [], 0
    for s in hp.stages:
        end = hp.total_steps if s.end_frac is None else round(s.end_frac * hp.scheduled_steps)
        bounds.append((start, end, s))
        start = end
    assert start == hp.total_steps, "the last stage must be the extension stage (end_frac=None)"
    return bounds


def stage_at(hp, step):
    for i, (start, end, s) in enumerate(stage_bounds(hp)):
        if step < end:
            return i, s
    return len(hp.stages) - 1, hp.stages[-1]


def lr_factor(hp, step):
    """Stage lr multiplier, decayed linearly to cooldown_floor over the last cooldown_frac of scheduled steps."""
    lr = stage_at(hp, step)[1].lr_mul
    cd_start = int(hp.scheduled_steps * (1 - hp.cooldown_frac))
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / max(1, hp.scheduled_steps - cd_start))
        lr = lr * (1 - t) + hp.cooldown_floor * t
    return lr


def muon_momentum(hp, step):
    lo, hi = hp.muon_momentum_min, hp.muon_momentum_max
    cd_start = hp.total_steps - hp.muon_cooldown_steps
    if step < hp.muon_warmup_steps:
        return lo + (hi - lo) * step / hp.muon_warmup_steps
    if step > cd_start:
        return hi - (hi - lo) * (step - cd_start) / hp.muon_cooldown_steps
    return hi


def slow_adam_step(hp, step):
    """Whether the slow Adam rows step: the last of every adam_every steps (the record's odd steps) and the last."""
    return step % hp.adam_every == hp.adam_every - 1 or step == hp.total_steps - 1


def untie_step(hp):
    """The first untied step: the one after stage untie_stage's first slow Adam step (917 of 1375; record #74's 967);
    None when that stage has none (cli.check_settings refuses it)."""
    start = stage_bounds(hp)[hp.untie_stage][0]
    return next((s + 1 for s in range(start, hp.total_steps) if slow_adam_step(hp, s)), None)


def windows_at(hp, step):
    return stage_at(hp, step)[1].windows


def val_windows(hp, step):
    """(windows, yarn_long) of the validation at ``step``: the step's windows; after the last step the long
    window widened to final_long_window with the last stage's YaRN tables (the record's final extension)."""
    short, long = windows_at(hp, min(step, hp.total_steps - 1))
    if step < hp.total_steps:
        return (short, long), None
    return (short, hp.final_long_window), long


def stage_progress(hp, step):
    """(the stage of a training step, the fraction of it done before the step); past the last stage, (it, 1.0)."""
    for start, end, s in stage_bounds(hp):
        if step < end:
            return s, (step - start) / (end - start)
    return hp.stages[-1], 1.0


def mtp_weights_at(hp, step):
    """Multi-token prediction weights (w_0, w_1, ...) of a training step: the stage's mtp_start moved linearly
    towards mtp_end by the fraction of the stage done (the public record's schedule); (1.0,) with --no-mtp."""
    if not hp.mtp:
        return (1.0,)
    s, t = stage_progress(hp, step)
    return tuple(a + (b - a) * t for a, b in zip(s.mtp_start, s.mtp_end))


def loss_weights_at(hp, step, K):
    """The training head's weights of a step: mtp_weights_at zero-padded to K (a weight of 0 adds nothing), and
    with --prefix-loss the prefix-token term's weight last (the stage's prefix pair, linear in the stage's
    fraction done, as the multi-token weights)."""
    w = mtp_weights_at(hp, step)
    w = w + (0.0,) * (K - len(w))
    if not hp.prefix_loss:
        return w
    s, t = stage_progress(hp, step)
    return w + (s.prefix[0] + (s.prefix[1] - s.prefix[0]) * t,)


def micro_tokens_at(hp, step):
    return stage_at(hp, min(step, hp.total_steps - 1))[1].batch_tokens // SLOTS


def check_world_size(world_size):
    if world_size not in (1, 2, 4, 8):
        raise SettingsError(f"world size {world_size} is not supported: it must divide the {SLOTS} micro-batches "
                            f"of the global batch (use 1, 2, 4 or 8 processes: torchrun --nproc_per_node)")
    return SLOTS // world_size


# -----------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class Param:
    """One row of the parameter table: everything the optimizer and the model need to know about a parameter."""
    optim: str  # "muon" (NorMuon on its matrices) or "adam"
    lr_mul: float = 1.0  # Adam: multiplier of adam_lr (Muon: max(1, rows / cols) ** 0.5 per matrix)
    betas: tuple = (0.9, 0.95)  # Adam (beta1, beta2)
    wd_mul: float = 0.0  # Adam: cautious decay adam_wd * wd_mul * lr^2 per update (Muon: muon_wd)
    slow: bool = True  # Adam: reduced and updated every adam_every steps, on the summed gradients
    matrix: bool = False  # stored in hp.param_dtype (bf16) with an fp32 master in the optimizer; else fp32
    region: bool = True  # read inside the compiled region (False: by the eager embedding lookups before it)
    proj: bool = False  # Muon: its odd matrices are W_proj^T, whose lr is mlp_proj_lr_mul times the others'
    tied_to: str = None  # until the untie, that row's transpose: its gradient is added there, its value copied back


# Every parameter, in reduce order: small Adam tensors first, then the big ones whose update waits longest
# (embed after lm_head: while tied its gradient is folded into the head's), the Muon banks last. The values
# are record #74's param_table; every Adam parameter steps on the odd steps only (adam_every=2), as there.
# Shapes and meaning: init_params.
PARAMS = {
    "scalars":        Param(optim="adam", lr_mul=5.0,  betas=(0.9, 0.99)),
    "resid_lambdas":  Param(optim="adam", lr_mul=5.0,  betas=(0.9, 0.95)),
    "post_lambdas":   Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.95)),
    "x0_lambdas":     Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.95)),
    "bigram_lambdas": Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.95)),
    "xsa_alpha":      Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.95)),  # ours (--xsa), no decay
    "mudd_bias":      Param(optim="adam", lr_mul=0.25, betas=(0.9, 0.99)),  # --mudd (record #81's table)
    "mudd_w2":        Param(optim="adam", lr_mul=0.25, betas=(0.9, 0.99),  wd_mul=1.0),
    "mudd_w1":        Param(optim="adam", lr_mul=0.25, betas=(0.9, 0.99),  wd_mul=1.0),
    "smear_gate":     Param(optim="adam", lr_mul=0.01, betas=(0.9, 0.99)),
    "skip_gate":      Param(optim="adam", lr_mul=0.05, betas=(0.9, 0.99)),
    "attn_gate":      Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.99),  wd_mul=1.0),
    "ve_gate":        Param(optim="adam", lr_mul=1.0,  betas=(0.9, 0.99),  wd_mul=1.0),
    "lm_head":        Param(optim="adam", lr_mul=1.0,  betas=(0.5, 0.95),  wd_mul=150.0, matrix=True),
    "value_embeds":   Param(optim="adam", lr_mul=75.0, betas=(0.75, 0.95), wd_mul=5.0,   matrix=True, region=False),
    "bigram_embed":   Param(optim="adam", lr_mul=75.0, betas=(0.75, 0.95), wd_mul=5.0,   matrix=True, region=False),
    "embed":          Param(optim="adam", lr_mul=1.0,  betas=(0.5, 0.95),  wd_mul=150.0, matrix=True, region=False,
                            tied_to="lm_head"),
    "attn_bank":      Param(optim="muon", matrix=True),
    "mlp_bank":       Param(optim="muon", matrix=True, proj=True),
}


def init_params(hp, device, seed):
    """All parameters (PARAMS) as a flat dict of leaf tensors: matrices in hp.param_dtype, the rest fp32."""
    g = torch.Generator().manual_seed(seed)
    C, V, L, G = hp.model_dim, hp.vocab_size, hp.num_layers, hp.gate_dims
    n_attn, H = len(hp.attn_layers), hp.num_heads  # shapes and indices: checked by cli.check_settings
    bound = 3 ** 0.5 * 0.5 * C ** -0.5  # uniform with std 0.5/sqrt(C), every attention matrix (W_o too)

    def uniform(*shape):
        return (torch.rand(*shape, generator=g) * 2 - 1) * bound

    mlp = torch.zeros(L, 2, hp.mlp_dim, C)
    mlp[:, 0] = uniform(L, hp.mlp_dim, C)  # W_fc; W_proj^T stays zero
    head = torch.randn(C, V, generator=g) * 0.005
    post = torch.ones(L, 2, 2)  # [layer, attention / MLP, lane 0 / lane 1]
    post[hp.parallel_start:, 0, 1] = 1.5  # attention writes more strongly into the MLP lane (public init)
    p = {
        "scalars": torch.cat([
            torch.tensor([0.5, 1.0]).repeat(n_attn),  # attention lambdas: (W_qkv, W_o) multipliers per layer
            torch.tensor([0.0, 0.5, -1.5]),  # smear_lambda, backout_lambda, skip_lambda (sigmoid(-1.5) ~ 0.18)
        ]),
        "resid_lambdas": torch.full((L, 2), 1.1 ** 0.5),  # residual scale per sublayer: x1.1 per layer at init
        "post_lambdas": post,  # sublayer output weight per lane
        "x0_lambdas": torch.zeros(L),  # weight of x0 added after each attention
        "bigram_lambdas": torch.full((L,), 0.05),  # weight of the bigram embedding per layer
        # --xsa: per layer and head, the share tanh(alpha) of the output's own-value part removed (xsa_part); zero,
        # so XSA starts off; the rows of layers without XSA (paired, no attention) are never read
        "xsa_alpha": torch.zeros(L, H),
        "smear_gate": torch.zeros(1, G),  # smear gate = smear_lambda * sigmoid(e[t, :G] . w)
        "skip_gate": torch.zeros(1, G),  # skip gate = sigmoid(skip_lambda) * 2 * sigmoid(x0[t, :G] . w)
        "attn_gate": torch.zeros(n_attn, H, G),  # output gate per attention layer and head
        "ve_gate": torch.zeros(sum(t >= 0 for t in hp.ve_tables), H, G),  # per layer with a value embedding
        "lm_head": head,  # (C, V): stored transposed
        "value_embeds": torch.randn(hp.num_ve * V, C, generator=g) * 0.01,  # the num_ve tables, stacked
        # zero-initialised, as in the public record; made on the device (the largest table: no host copy)
        "bigram_embed": torch.zeros(hp.bigram_vocab_size, C, device=device),
        "embed": head.T.contiguous(),  # tied to lm_head at init
        "attn_bank": uniform(n_attn * 4, C, C),  # [Wq, Wk, Wv, Wo] per attention layer
        "mlp_bank": mlp.reshape(L * 2, hp.mlp_dim, C),  # [W_fc, W_proj^T] per layer
    }
    p.update(mudd_init(hp, g))  # drawn after the others, so that their values do not depend on it
    # Feature parameters exist whatever the flags (a disabled feature leaves its zero gradient unused), so the
    # optimizer's table and a checkpoint's keys do not depend on the flags.
    p = {k: p[k] for k in PARAMS}
    assert list(p) == list(PARAMS)
    dtype = getattr(torch, hp.param_dtype)
    return {k: v.to(device=device, dtype=dtype if PARAMS[k].matrix else torch.float32).requires_grad_()
            for k, v in p.items()}


# --mudd (record #81): two small per-token MLPs, x (T, C) -> gelu(x W1^T) (T, MUDD_HIDDEN) -> (T, 2, MUDD_COLS)
# coefficients, (h W2 + bias) * MUDD_SCALE. Row 0 reads the stream after layer L-2 (its MLP done); its channel
# 0 / 1 columns: the value correction's / the stream's weights of (start, back, self), then layer L-1's value-
# embedding gate (both channels, each for half the heads), its residual and output weights (channel 0 attention,
# 1 MLP) and, channel 0 only, its x0 and bigram weights. Row 1 reads the stream after layer L-1; channel 1's
# first five columns weigh (start, back, the stream after layer L-2, value-embedding table 0, skip) into the
# final stream. start: the stream before layer 0 (x0 plus layer 0's bigram), back: backout_layer's output.
MUDD_HIDDEN, MUDD_COLS, MUDD_FINAL_SOURCES = 64, 8, 5
MUDD_SCALE = 0.2 / 3 ** 0.5  # the record's 0.2 / sqrt(3 sources)
MUDD_V_GAIN = 1.15  # the value correction's fixed gain (the record's)
MUDD_BACKOUT = -4.34  # row 1's bias on back: -0.501 after MUDD_SCALE, the backout it replaces (backout_lambda 0.5)


def mudd_init(hp, g):
    """--mudd's parameters: W1 (2, MUDD_HIDDEN, C) uniform in +-1/sqrt(C) (torch's default Linear init), W2
    (2, MUDD_HIDDEN, 2, MUDD_COLS) zero, so that every coefficient starts at its bias * MUDD_SCALE: layer L-1's
    residual weights sqrt(1.1), output weights 1, bigram weight 0.05 (as the static scalars they replace), the
    rest 0 but the final mix's -0.5 x back (the backout)."""
    C = hp.model_dim
    bias = torch.zeros(2, 2, MUDD_COLS)
    bias[0, :, 4] = 1.1 ** 0.5 / MUDD_SCALE  # layer L-1: residual weight of attention (0) and MLP (1)
    bias[0, :, 5] = 1.0 / MUDD_SCALE  # layer L-1: output weight of attention (0) and MLP (1)
    bias[0, 0, 7] = 0.05 / MUDD_SCALE  # layer L-1: bigram weight (its x0 weight, column 6, starts at 0)
    bias[1, 1, 1] = MUDD_BACKOUT
    w1 = (torch.rand(2, MUDD_HIDDEN, C, generator=g) * 2 - 1) * C ** -0.5
    return {"mudd_bias": bias, "mudd_w2": torch.zeros(2, MUDD_HIDDEN, 2, MUDD_COLS), "mudd_w1": w1}


# -----------------------------------------------------------------------------
# Model pieces: functions of tensors (weights are arguments), traced into the compiled region by build_fns


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary_freq(hp):
    """(D/2,) fp32 angular frequencies of the rotary pairs (x[i], x[i + D/2]): D/4 of them from 1 down to
    1/1024 rad per token, the other D/4 zero (position-free dims)."""
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=hp.head_dim // 4, dtype=torch.float32)
    return torch.cat([freq, freq.new_zeros(hp.head_dim // 4)])


def yarn_update(freq, scale, old, new, alpha=1, beta=32):
    """The public record's YaRN step when the long window grows from ``old`` to ``new`` tokens: a frequency
    that turns fewer than alpha times over the old window is divided by new/old (interpolated), one turning
    more than beta times is kept, a linear ramp in between; the softmax scale grows by 0.2 ln(new/old) + 1."""
    turns = old * freq / (2 * math.pi)
    ratio = old / new
    ramp = ((turns - alpha) / (beta - alpha)).clamp(0, 1)
    return freq * (ratio + ramp * (1 - ratio)), scale * (0.2 * math.log(new / old) + 1)


def yarn_state(hp, long_window):
    """(freq (D/2,) fp32 on the CPU, softmax scale) for attention whose long window is ``long_window`` blocks.

    As in the public record the update is applied at every change of the long window along the stage table
    (it depends on the path: each step reads the frequencies the previous one left), starting from
    rotary_freq and hp.attn_scale; a window the table never reaches is one update from the first stage's.
    Without --yarn: the base frequencies and hp.attn_scale. Computed on the host once per window (cached)."""
    freq, scale = rotary_freq(hp), hp.attn_scale
    if not hp.yarn:
        return freq, scale
    path = []
    for st in hp.stages:
        if not path or path[-1] != st.windows[1]:
            path.append(st.windows[1])
        if st.windows[1] == long_window:
            break
    if path[-1] != long_window:
        path = [path[0], long_window]
    for old, new in zip(path, path[1:]):
        freq, scale = yarn_update(freq, scale, old * BLOCK, new * BLOCK)
    return freq, scale


def rotary_tables(hp, T, device, dtype, freq=None, paired=False):
    """The tables rotary multiplies by, full width: cos (T, 1, D) = [c, c] and sin (T, 1, D) = [s, -s], with c and
    s (T, 1, D/2) the cosine and sine of angle position * freq (default: rotary_freq), rounded to dtype. paired:
    (T, H, D), head h at token t rotated as position 2t + h % 2 (the public record's paired-head tables: the two
    heads of a pair are consecutive positions of the interleaved sequence)."""
    freq = (rotary_freq(hp) if freq is None else freq).to(device)
    pos = torch.arange(T, dtype=torch.float32, device=device)[:, None]
    if paired:
        pos = 2 * pos + (torch.arange(hp.num_heads, device=device) % 2)[None]
    theta = pos[..., None] * freq  # (T, 1 or H, D/2), one fp32 product per entry as torch.outer
    c, s = theta.cos().to(dtype), theta.sin().to(dtype)
    return torch.cat([c, c], -1), torch.cat([s, -s], -1)


def bigram_hash(ids, rows, bos_id):
    """(T,) int32 row of the bigram table per position: the public record's hash of (previous id, id),
    (36313 * ids[t] xor 27191 * ids[t-1]) mod (rows - 1). A position without a previous token of its own
    document, position 0 and every BOS, gets the reserved last row, rows - 1 (the record reserves it for
    position 0 only and lets a BOS hash with the previous document's last token; we keep documents
    independent, so a packed sequence scores like its documents one by one). int64 arithmetic: the same
    values as the record's int32 for ids < 2^31 / 36313 (59138), which covers GPT-2's vocabulary."""
    x = ids.to(torch.int64)
    out = torch.full_like(x, rows - 1)
    out[1:] = torch.bitwise_xor(36313 * x[1:], 27191 * x[:-1]) % (rows - 1)
    return torch.where(x == bos_id, rows - 1, out).to(torch.int32)


def rotary(x, cos, sin):
    """x (..., D) with each pair (x1, x2) = (x[i], x[i + D/2]) turned to (x1 c + x2 s, x2 c - x1 s), from rotary_tables'
    full-width cos = [c, c] and sin = [s, -s]: x * cos + swap(x) * sin, swap exchanging the two halves of the last
    dim. Elementwise, with the halves' exchange an index map (a flip of the (2, D/2) view): the compiled forward and
    backward need no slices or concatenation, and each element is the same two products and one sum (-(x1 s) is
    x1 (-s) exactly)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


def pair_heads(t):
    """(T, H, D) -> (2T, H/2, D), row 2t + j holding heads j H/2 .. (j + 1) H/2 - 1 of token t: the paired-head
    layers' interleaved sequence. A split of the head dimension, then a merge of T with the 2: with T a dynamic size
    (--dynamic-tokens) inductor indexes that as a view of its input; ``reshape(2T, H/2, D)`` gives it an index
    modulo 6T that it cannot prove redundant, and it copies the tensor (a kernel per q, k and v)."""
    T, H, D = t.shape
    return t.view(T, 2, H // 2, D).flatten(0, 1)


def offset_keys(k, bos):
    """k (T, H, D) with k[t]'s position-free dims (the rotary pairs of zero frequency) taken from k[t-1], except at
    t = 0 and where bos[t] ((T,) bool; the public record shifts across documents too): one layer can then form
    induction heads. The previous token's key is read through a shift (F.pad of k[:-1]), not a concatenation:
    elementwise in the compiled forward and backward."""
    T, D = k.shape[0], k.shape[-1]
    stationary = torch.arange(D, device=k.device) % (D // 2) >= D // 4
    own = bos | (torch.arange(T, device=k.device) == 0)
    return torch.where(stationary & ~own[:, None, None], F.pad(k[:-1], (0, 0, 0, 0, 1, 0)), k)


XSA_V2_FLOOR = 1e-8  # v.v below this is taken as this: record #82's v / max(|v|, 1e-4), squared


def xsa_part(y, v):
    """y, v (T, H, D) -> (T, H, D): each head's output y[t, h] projected on its token's own value v[t, h],
    ((y . v) / (v . v)) v, with v . v floored at XSA_V2_FLOOR. Record #82 projects on v / max(|v|, 1e-4), which is
    the same for |v| >= 1e-4 and, below, our floor of v . v at (1e-4)^2; v = 0 gives a zero part (no NaN, and a
    zero gradient). The reductions over D run in the tensors' dtype, as torch sums (fp32 accumulation for bf16)."""
    return (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp_min(XSA_V2_FLOOR) * v


def make_attn_sublayer(hp, attend):
    H, D, G = hp.num_heads, hp.head_dim, hp.gate_dims

    def attn_sublayer(x, w_qkv, w_o, attn_gate, ve, ve_gate, cos, sin, qscale, seq, window,
                      paired=False, key_offset=False, bos=None, xsa=None, v_add=None, ve_gate_out=None):
        """x (T, C) lane -> attention output (T, C).

        w_qkv (3C, C): [W_q; W_k; W_v], and w_o (C, C): views of the attention bank (make_layers), with
        --attn-lambdas already multiplied by the layer's W_qkv and W_o lambdas. ve (T, C) and ve_gate (H, G) or
        both None.
        cos/sin: rotary_tables (T, 1, D), or (T, H, D) when paired. qscale 0-d: the softmax scale,
        applied to q (a tensor: YaRN changes it without a recompile). The gates and qscale are fp32 or
        already in x's dtype (make_layers casts them once per micro-step): each is cast to x's dtype here.
        seq: the DocSeq of the sequence, or with paired of the interleaved 2T sequence; window: 0-d int64 CPU
        tensor, in tokens. key_offset: the keys' position-free dims taken from the previous token's (offset_keys;
        bos (T,) bool). xsa (H,): --xsa's tanh(alpha) per head, or None; not with paired (hp.xsa_layers): each head's
        output loses that share of its part along its token's own value v (xsa_part), before the output gate.
        --mudd's layer L-1 (not paired): v_add (T, H, D) is added to the values, and ve_gate_out (T, H) is the
        value embedding's gate itself (in place of 2 * sigmoid(...) of ve_gate)."""
        if paired and xsa is not None:
            raise ValueError("attn_sublayer: XSA needs one value vector per head and token (no paired heads)")
        T, C = x.shape
        h = rms_norm(x)
        q, k, v = (h @ w_qkv.T).view(T, 3, H, D).unbind(1)
        if v_add is not None:
            v = v + v_add
        q = rotary(rms_norm(q), cos, sin) * qscale.to(h.dtype)
        k = rotary(rms_norm(k), cos, sin)
        if key_offset:
            k = offset_keys(k, bos)
        if ve is not None:
            # The record's gate input: the first G dims of the normed input in paired layers, else its first G/2
            # dims next to the value embedding's first G/2.
            if ve_gate_out is not None:
                gate = ve_gate_out
            else:
                g_in = h[:, :G] if paired else torch.cat([h[:, :G // 2], ve[:, :G - G // 2]], dim=-1)
                gate = 2 * torch.sigmoid(g_in @ ve_gate.to(h.dtype).T)  # (T, H)
            v = v + gate[..., None] * ve.view(T, H, D)
        if paired:
            # The public record's construction: each token's H*D values read as two tokens of H/2 heads, so
            # new head j sees old head j at position 2t and old head j + H/2 at 2t + 1 (queries of one attend
            # to keys of both); windows count tokens of the 2T sequence (half the reach).
            q, k, v = (pair_heads(t) for t in (q, k, v))
        y = attend(q, k, v, seq, window, 1.0).reshape(T, H, D)
        if xsa is not None:
            y = y - xsa.to(y.dtype)[:, None] * xsa_part(y, v)
        y = y * torch.sigmoid(h[:, :G] @ attn_gate.to(h.dtype).T)[..., None]
        return y.reshape(T, C) @ w_o.T

    return attn_sublayer


def mudd_coefficients(x, w1, w2, bias):
    """--mudd: x (T, C), w1 (MUDD_HIDDEN, C), w2 (MUDD_HIDDEN, *S), bias S -> (T, *S) per-token coefficients,
    (gelu(x w1^T) w2 + bias) * MUDD_SCALE; all in x's dtype (the caller casts the weights)."""
    h = F.gelu(x @ w1.T)
    return ((h @ w2.flatten(1)).view(x.shape[0], *w2.shape[1:]) + bias) * MUDD_SCALE


class MuddGates(NamedTuple):
    """What --mudd's layer L-2 hands layer L-1, each per token: the value correction (T, H, D), the value
    embedding's gate (T, H), and (T, 1) weights: attention's residual / output, the MLP's, x0's and the bigram's."""
    v_add: torch.Tensor
    ve_gate: torch.Tensor
    resid_attn: torch.Tensor
    post_attn: torch.Tensor
    resid_mlp: torch.Tensor
    post_mlp: torch.Tensor
    x0: torch.Tensor
    bigram: torch.Tensor


def mudd_layer(x, start, back, w1, w2, bias, num_heads):
    """--mudd after layer L-2's MLP: x (T, C) -> (new stream, MuddGates for layer L-1). With c =
    mudd_coefficients(x, ...) (T, 2, MUDD_COLS): the stream becomes (1 + c[1, 2]) x + c[1, 0] start + c[1, 1] back,
    the value correction is MUDD_V_GAIN (c[0, 0] start + c[0, 1] back + c[0, 2] x) as (T, H, D), and head h's value
    gate is c[h // (H / 2), 3] + 2 (the static gate's 2 sigmoid(.) starts at 1)."""
    T, C = x.shape
    c = mudd_coefficients(x, w1, w2, bias)
    cv, cr = c[:, 0, :3].unsqueeze(-1).unbind(1), c[:, 1, :3].unsqueeze(-1).unbind(1)
    v_add = (MUDD_V_GAIN * (cv[0] * start + cv[1] * back + cv[2] * x)).view(T, num_heads, C // num_heads)
    new = (1 + cr[2]) * x + cr[0] * start + cr[1] * back
    ve_gate = c[:, :, 3, None].expand(T, 2, num_heads // 2).reshape(T, num_heads) + 2  # channel j: heads of half j
    col = c.unsqueeze(-1)  # (T, 2, MUDD_COLS, 1): a column as (T, 1)
    return new, MuddGates(v_add, ve_gate, col[:, 0, 4], col[:, 0, 5], col[:, 1, 4], col[:, 1, 5], col[:, 0, 6],
                          col[:, 0, 7])


def mudd_final(x, sources, w1, w2, bias):
    """--mudd after layer L-1: x + sum_j c_j sources[j], c = mudd_coefficients(x, w1, w2[:, 1, :5], bias[1, :5])
    (row 1's channel 1), sources (start, back, stream after layer L-2, value-embedding table 0, skip), each (T, C)."""
    c = mudd_coefficients(x, w1, w2[:, 1, :MUDD_FINAL_SOURCES], bias[1, :MUDD_FINAL_SOURCES])
    for j, src in enumerate(sources):
        x = x + c[:, j:j + 1] * src
    return x


def mlp_sublayer(x, w_fc, w_proj_t):
    """x (T, C) lane -> relu(norm(x) W_fc^T)^2 W_proj^T, with W_proj^T stored (mlp_dim, C)."""
    return F.relu(rms_norm(x) @ w_fc.T).square() @ w_proj_t


def fused_mlp_sublayer(x, w_fc, w_proj_t, act_only=False):
    """mlp_sublayer through kernels.mlp.relu2_mlp (CUDA, bf16; --fused-mlp): the ReLU² and its derivative in the
    up-projection's matmul epilogues, no elementwise pass over the (T, mlp_dim) activation. act_only
    (--mlp-act-only): the forward writes and saves act alone, the backward takes relu(pre) as sqrt(act)."""
    return relu2_mlp(rms_norm(x), w_fc, w_proj_t, act_only)


def attn_residual(lane0, lane1, out, inject, resid, post, weighted=False):
    """After an attention sublayer: lane <- resid * lane + out (+ inject, lane 0 only) with one lane; with two,
    lane0 <- resid * lane0 + post[0] * out + inject and lane1 <- resid * lane1 + post[1] * out (record #74's
    single-lane layers have no output weight; weighted, as in --one-stream, one lane gets post[0] * out).
    inject: x0_lambda * x0 [+ bigram_lambda * bigram] (T, C). resid and post (lane 0's, lane 1's output weights,
    None where unread): (T, 1) columns, fp32 (make_layers' weight columns) or in the lanes' dtype (--mudd's layer
    L-1). Each new lane is taken in the operands' common dtype and rounded to the lanes' dtype once."""
    dt, (w0, w1) = lane0.dtype, post
    if lane1 is None:
        return (resid * lane0 + (w0 * out if weighted else out) + inject).to(dt), None
    return (resid * lane0 + w0 * out + inject).to(dt), (resid * lane1 + w1 * out).to(dt)


def mlp_residual(lane0, lane1, out, resid, post):
    """After an MLP sublayer: lane_j <- resid * lane_j + post[j] * out for each lane there is (resid and post as
    attn_residual's)."""
    dt, (w0, w1) = lane0.dtype, post
    return (resid * lane0 + w0 * out).to(dt), None if lane1 is None else (resid * lane1 + w1 * out).to(dt)


def embed_prelude(e, bigram, smear_gate, smear_lambda, b_lam0, bos):
    """Token embeddings e (T, C) -> (x0, lane 0 before layer 0).

    Smear (smear_gate (1, G) or None): e[t] += smear_lambda * sigmoid(e[t, :G] . smear_gate) * e[t-1] for t > 0
    except where bos[t] ((T,) bool: the record smears across documents, we keep them independent).
    x0 = norm(e); lane 0 = x0 + b_lam0 * bigram (bigram (T, C) or None; b_lam0 a (T, 1) fp32 column: the sum
    rounded to x0's dtype once)."""
    G = smear_gate.shape[-1] if smear_gate is not None else 0
    if smear_gate is not None:
        g = smear_lambda.to(e.dtype) * torch.sigmoid(e[1:, :G] @ smear_gate.to(e.dtype).T)  # (T-1, 1)
        g = g * (~bos[1:, None]).to(e.dtype)
        e = torch.cat([e[:1], e[1:] + g * e[:-1]])
    x0 = rms_norm(e)
    return x0, (x0 if bigram is None else (x0 + b_lam0 * bigram).to(x0.dtype))


SOFTCAP_B, SOFTCAP_C = 5.0, 7.5  # logits -> softcap * sigmoid((logits + B) / C)


def head_mm(x, lm_head):
    """x (N, C) @ lm_head (C, V). On the CPU, bf16 operands are multiplied in fp32 and the product rounded once to
    bf16: what a GPU's bf16 matmul computes (fp32 accumulation), and faster than torch's CPU bf16 kernel (the
    smoke run's largest cost; notes/measurements.md)."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        return (x.float() @ lm_head.float()).to(x.dtype)
    return x @ lm_head


def head_logits(x, lm_head, softcap):
    """Soft-capped fp32 logits (evaluation and sampling; never FP8)."""
    logits = head_mm(rms_norm(x), lm_head)  # (T, V), head stored (C, V)
    return softcap * torch.sigmoid((logits.float() + SOFTCAP_B) / SOFTCAP_C)


def head_loss(x, lm_head, targets, weights, softcap, ce, fp8, grad_in_fwd=False, head8=None):
    """Mean over the N rows of sum_k w_k CE(row t, targets[t + k]) (t + k < N) of the soft-capped logits softcap *
    sigmoid((logits + 5) / 7.5); weights (K,) fp32 on the device; (1.0,): the next-token CE. targets (2, N)
    (--prefix-loss): row 0 those targets, with the first K - 1 weights, and row 1 one more target per row (-1:
    none), weighted by the last. ce: softcapped_cross_entropy (CUDA) or its _ref (CPU). fp8: through fp8_head_ce, on
    the normed x's e4m3 copy (made here, by the final norm's kernel in the compiled step) and head8 =
    fp8_head_weights(lm_head, FP8_W_S) (the caller's, made once per optimizer step). grad_in_fwd (CUDA): the CE
    forward kernel also writes the logits' gradient, for the gradient train_step gives the loss (1 / SLOTS; any
    other is scaled in the backward)."""
    xn = rms_norm(x)
    if fp8:
        N = x.shape[0]
        if head8 is None:
            raise ValueError("head_loss: the FP8 head multiplies head8 = fp8_head_weights(lm_head, FP8_W_S)")
        x8 = fp8_e4m3(xn.detach(), FP8_X_S)
        # the gradient's scale FP8_GRAD_S / (N * SLOTS), its divisor an int: a symbolic size where N is dynamic
        if grad_in_fwd:
            return fp8_head_ce_grad_in_fwd(xn, lm_head, x8, *head8, targets, weights, FP8_X_S, FP8_W_S, FP8_GRAD_S,
                                           1 / SLOTS, softcap, SOFTCAP_B, SOFTCAP_C, N * SLOTS)[0]
        return fp8_head_ce(xn, lm_head, x8, *head8, targets, weights, FP8_X_S, FP8_W_S, FP8_GRAD_S, softcap,
                           SOFTCAP_B, SOFTCAP_C, N * SLOTS)[0].mean()
    if grad_in_fwd:
        return head_ce_grad_in_fwd(xn, lm_head, targets, weights, 1 / SLOTS, softcap, SOFTCAP_B, SOFTCAP_C)[0]
    return ce(head_mm(xn, lm_head), targets, weights, softcap, SOFTCAP_B, SOFTCAP_C).mean()


def prefix_token_table(encoding, vocab_size):
    """--prefix-loss (record #88's idea): (vocab_size,) int64, for each id the id of the longest proper prefix of its
    bytes that is itself a token of ``encoding`` (tiktoken's gpt2: its byte-pair tokens, ids below eot_token), or -1
    (no such prefix: single bytes; the end-of-text id and the vocabulary's padding rows; a prefix id >= vocab_size).
    head_loss scores each position also on its target's prefix token (kernels.cross_entropy's extra term, -1: none).
    """
    ids = {encoding.decode_single_token_bytes(i): i for i in range(encoding.eot_token)}
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    for b, i in ids.items():
        if i >= vocab_size:
            continue
        for n in range(len(b) - 1, 0, -1):
            p = ids.get(b[:n])
            if p is not None:
                table[i] = p if p < vocab_size else -1
                break
    return table


# -----------------------------------------------------------------------------
# The model: embeddings (eager) -> layers + head (one compiled region per micro-batch shape)


class AttnTables(NamedTuple):
    """What attention needs besides the tokens, for micro-batches of T tokens at windows (short, long): tensors
    made once per (T, windows) on the host and passed to the compiled region as arguments, so that a stage
    change never recompiles it and no step copies anything from the host."""
    cos: torch.Tensor  # (T, 1, D) rotary_tables, YaRN-adjusted for the long window
    sin: torch.Tensor
    paired_cos: Optional[torch.Tensor]  # (T, H, D) for paired-head layers (None without them)
    paired_sin: Optional[torch.Tensor]
    qscale: torch.Tensor  # 0-d fp32 softmax scale (YaRN grows it with the long window)
    short: torch.Tensor  # 0-d int64 CPU tensor: the short window in tokens (read by doc_attention on the host)
    long: torch.Tensor  # 0-d int64 CPU tensor: the long window in tokens
    # Longest document (FlashAttention's grid): max_doc_len in training, T otherwise. An int, or (dynamic) the
    # length of an empty (max_len, 0) CPU tensor: a size, so that the compiled step reads it as a symbol, not a
    # constant (doc_len_bound).
    max_len: int | torch.Tensor


def doc_len_bound(tables):
    """AttnTables.max_len as a size: the int, or the length of its (max_len, 0) tensor (symbolic when compiled)."""
    return tables.max_len if isinstance(tables.max_len, int) else tables.max_len.shape[0]


def attn_tables(hp, T, windows, cache, device, max_len=None, yarn_long=None, dynamic=False):
    """The AttnTables of T tokens at windows (short, long) in blocks, cached in ``cache`` per (T, windows,
    max_len, yarn_long, dynamic). max_len: the longest document the sequences can hold (default T). yarn_long: the
    long window whose YaRN frequencies and softmax scale are used (default windows[1]; the final validation widens
    the window without re-scaling, as the record does). dynamic (--dynamic-tokens' training step): the tables' T
    dimension and max_len, a tensor's length, are marked dynamic (mark_tokens_dynamic) when they are made."""
    if T % BLOCK:
        raise ValueError(f"micro-batch length {T} must be a multiple of {BLOCK} (the window unit)")
    max_len = T if max_len is None else min(max_len, T)
    yarn_long = windows[1] if yarn_long is None else yarn_long
    key = ("tables", T, tuple(windows), str(device), max_len, yarn_long, dynamic)
    if key not in cache:
        dtype = getattr(torch, hp.param_dtype)
        freq, scale = yarn_state(hp, yarn_long)
        cos, sin = rotary_tables(hp, T, device, dtype, freq)
        pcos, psin = rotary_tables(hp, T, device, dtype, freq, paired=True) if hp.paired_layers else (None, None)
        short, long = (torch.tensor(w * BLOCK, dtype=torch.int64) for w in windows)
        bound = max_len
        if dynamic:
            bound = torch.empty(max_len, 0, dtype=torch.int8)
            mark_tokens_dynamic(cos, sin, pcos, psin, bound)
        cache[key] = AttnTables(cos, sin, pcos, psin, torch.tensor(scale, dtype=torch.float32, device=device),
                                short, long, bound)
    return cache[key]


def mark_tokens_dynamic(*tensors):
    """--dynamic-tokens: dim 0 of each tensor (None: skipped), the micro-batch's T tokens or the documents' length
    bound, a dynamic size of the compiled training step (torch._dynamo.mark_dynamic, an API call on its inputs, not
    a compile option), so that one graph serves every stage. Every input with a T dimension must be marked: a
    static one would make T a constant again. The region must not turn T into a Python number either (a float or
    a grid computed from it is a guard, and a recompile, per length): tests/test_train_gpt.py counts the frames."""
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, 0)


def embed_inputs(hp, params, ids, lookup, prep=None, bigram=None, bigram_prep=None, accs=None):
    """(token embeddings e (T, C), [value embeddings (T, C)] per table, bigram embeddings (T, C) or None), eager.
    lookup: kernels.embedding.embedding (CUDA) or cpu_embedding. accs (training with ModelFns.embed_accs:
    Optimizer.embedding_accs()): each lookup's backward adds its table's gradient into these fp32 accumulators."""
    accs = accs or {}
    e = lookup(ids, params["embed"], prep=prep, acc=accs.get("embed"))
    ve_w = params["value_embeds"].view(hp.num_ve, hp.vocab_size, hp.model_dim)
    # unbind (not indexing): its backward writes the tables' gradients with one stack (none with accs)
    ve_accs = accs.get("value_embeds", [None] * hp.num_ve)
    ves = [lookup(ids, w, prep=prep, acc=a) for w, a in zip(ve_w.unbind(0), ve_accs, strict=True)]
    big = None
    if hp.bigram:
        if bigram is None:
            bigram = bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id)
        big = lookup(bigram, params["bigram_embed"], prep=bigram_prep, acc=accs.get("bigram_embed"))
    return e, ves, big


def take(t, read):
    """{i: t[i]} for the indices i in read (t's first dimension), as the unbound slices of read's runs of
    consecutive indices. The backward then writes the read rows' gradients alone (unbind's stack, into which the
    scalars' gradient sums write directly) and pads the runs with zeros in one elementwise pass: an unbind of all of
    t fills each unread row's zero gradient in a launch of its own, and indexing the rows of an unbind puts each
    row's gradient back together in one more."""
    out, read = {}, sorted(set(read))
    starts = [k for k in range(len(read)) if k == 0 or read[k] != read[k - 1] + 1]  # where each run begins
    for a, b in zip(starts, starts[1:] + [len(read)]):
        run = read[a:b]
        out.update(zip(run, t[run[0]:run[-1] + 1].unbind(0), strict=True))
    return out


def scalar_reads(hp):
    """The entries of the scalar and gate tables that make_layers reads in hp's configuration, per table, as
    indices into the views make_layers takes them from: scalars[:n + 2] (n = 2 * attention layers: the (W_qkv, W_o)
    lambdas, then smear and backout), resid_lambdas flat (2 layer + sublayer; sublayer 0 attention, 1 MLP),
    post_lambdas permuted to (lane, layer, sublayer) and flat, and the rows of x0_lambdas, bigram_lambdas,
    xsa_alpha and ve_gate. Layer L-1 with --mudd takes per-token weights in place of its scalars and value gate; the
    attention's output weight is read on one stream (lane 0) and where two lanes run (both), the MLP's lane-0 weight
    always."""
    L, n = hp.num_layers, 2 * len(hp.attn_layers)
    static = [i for i in range(L) if not (hp.mudd and i == L - 1)]
    attn = [i for i in static if i not in hp.no_attn_layers]
    two = [i >= hp.parallel_start and not hp.one_stream for i in range(L)]
    post = [2 * i for i in attn if hp.one_stream or two[i]] + [2 * i + 1 for i in static]
    post += [2 * L + 2 * i + s for i in static for s in (0, 1) if two[i] and (s or i in attn)]
    ve_layers = [i for i in hp.attn_layers if hp.ve_tables[i] >= 0]  # ve_gate's rows, in order
    return {
        "scalars": ([*range(n)] if hp.attn_lambdas else []) + ([n] if hp.smear else [])
        + ([n + 1] if hp.backout and not hp.mudd else []),
        "resid": [2 * i + s for i in static for s in (0, 1) if s or i in attn],
        "post": post,
        "x0": attn,
        "bigram": [0] + [i for i in attn if i > 0] if hp.bigram else [],
        "xsa": list(hp.xsa_layers),
        "ve_gate": [v for v, i in enumerate(ve_layers) if i in static],
    }


def make_layers(hp, attend, mlp=mlp_sublayer):
    """The function layers(params, e, ves, big, ids, cu, tables) -> final residual (T, C): the embedding prelude
    (smear, norm, bigram), every layer, the lane merge and backout, as straight-line tensor code (compiled as
    one region with the head on CUDA). cu: doc_cu_seqlens(ids) on the device. attend and mlp: the attention
    function and the MLP sublayer (mlp_sublayer or fused_mlp_sublayer). --one-stream (record #77): lane 0
    alone, every attention output weighted by its post lambda, the attention layers after backout_layer read
    that layer's output instead of the stream, and the skip is saved after skip_from's MLP. --mudd (record #81, on
    one stream): after layer L-2, mudd_layer mixes earlier states into the stream and makes layer L-1's value
    correction and per-token gates and weights (in place of its static scalars); after layer L-1, mudd_final mixes
    five states into the final stream, which takes the backout's place (no backout_lambda)."""
    attn = make_attn_sublayer(hp, attend)
    paired, xsa_layers = hp.paired_layers, set(hp.xsa_layers)
    reads, L = scalar_reads(hp), hp.num_layers

    def layers(params, e, ves, big, ids, cu, tables):
        bos = ids == hp.bos_id
        # The document structure for attention: for the sequence and (paired heads) its interleaved 2T copy, where
        # every document is twice as long. docs (cumulative BOS count) serves the dense CPU path only (unused,
        # and dropped by the compiler, on CUDA).
        docs = doc_ids(ids, hp.bos_id)
        max_len = doc_len_bound(tables)
        seq = DocSeq(cu, docs, max_len)
        seq2 = DocSeq(2 * cu, docs.repeat_interleave(2), 2 * max_len) if paired else None
        windows = {"short": tables.short, "long": tables.long}
        # Each fp32 scalar and gate table is cast to the lanes' dtype once, as a whole, and the entries this
        # configuration reads are taken from it (take; scalar_reads): per use, every scalar would be a cast of its
        # own, one tiny kernel in the forward and one in the backward per use. Every element is still cast once, so
        # its fp32 gradient is its one low-precision gradient, converted.
        lp = e.dtype
        n = 2 * len(hp.attn_layers)  # scalars: (W_qkv, W_o) multipliers per attention layer, smear, backout, skip
        scalars = take(params["scalars"][n:n + 2].to(lp), [j - n for j in reads["scalars"] if j >= n])
        smear_lambda, backout_lambda = scalars.get(0), scalars.get(1)
        skip_lambda = params["scalars"][n + 2]  # fp32: the skip gate's sigmoid is taken before the cast
        # The residual, output, x0 and bigram weights enter as (T, 1) fp32 columns of one table expanded over the
        # tokens, holding their lp values (the lanes' arithmetic takes them in fp32 and rounds once, as the
        # compiled kernels do with lp scalars). A weight's gradient is then a column of per-token partial sums,
        # written by the kernels that reduce over the token's row anyway, and the expand's backward sums every
        # column in one reduction (a 0-d weight's gradient is a reduction kernel of its own). The gradient is
        # still rounded to lp once, at the cast, before its conversion to fp32.
        # The table holds the tables as stored, flat: resid (L, 2), post (L, 2, 2) (layer, sublayer, lane), x0,
        # bigram. post's reads j count in (lane, layer, sublayer) order and are mapped to the stored order: a
        # constant-index load from a permuted piece of the cat gets an unevaluated ModularIndexing in inductor's
        # Triton code (torch 2.11), which does not compile.
        offset = {"resid": 0, "post": 2 * L, "x0": 6 * L, "bigram": 7 * L}

        def row(k, j):
            return offset[k] + (4 * (j % (2 * L) // 2) + 2 * (j % 2) + j // (2 * L) if k == "post" else j)

        weights = torch.cat([params["resid_lambdas"].view(-1), params["post_lambdas"].view(-1), params["x0_lambdas"],
                             params["bigram_lambdas"]]).to(lp).float()
        cols = take(weights[:, None].expand(-1, e.shape[0]), [row(k, j) for k in offset for j in reads[k]])
        resid, post, x0_lams, b_lams = ({j: cols[row(k, j)][:, None] for j in reads[k]} for k in offset)
        x0, lane0 = embed_prelude(e, big, params["smear_gate"] if hp.smear else None, smear_lambda, b_lams.get(0),
                                  bos)
        bank = params["attn_bank"]  # (4 A, C, C): [W_q, W_k, W_v, W_o] per attention layer
        if hp.attn_lambdas:
            # The weights pre-multiplied, as the public record does (not the outputs): W_q, W_k and W_v by the
            # layer's first lambda, W_o by its second, the whole bank in one elementwise pass. Each lambda's
            # gradient is then a sum over its matrices in one reduction over the bank's gradient (per matrix, each
            # would be a split reduction of two kernels). The lambdas hold their lp values in fp32: each product is
            # rounded once to the bank's dtype, as lp * lp is, and each gradient is summed in fp32 and rounded to
            # lp once, at the cast.
            A = len(hp.attn_layers)
            lam = params["scalars"][:n].to(lp).float().view(A, 2, 1, 1)
            mul = torch.cat([lam[:, :1].expand(A, 3, 1, 1), lam[:, 1:]], dim=1).view(4 * A, 1, 1)
            bank = (mul * bank).to(bank.dtype)
        # Each layer reads [W_q; W_k; W_v] as one (3C, C) view of the bank and W_o as another: the backward's
        # gradient of the bank is then assembled from whole matmul outputs (a cat of the three matrices would be
        # a copy, and its backward three slices copied into the bank's gradient).
        attn_w = [(bank[4 * a:4 * a + 3].flatten(0, 1), bank[4 * a + 3]) for a in range(bank.shape[0] // 4)]
        mlp_w = params["mlp_bank"].unbind(0)
        attn_gates = params["attn_gate"].to(lp).unbind(0)
        # --xsa: tanh(alpha) of every layer and head, taken in fp32 and cast once (the rows XSA skips are unread)
        xsa = take(torch.tanh(params["xsa_alpha"]).to(lp), reads["xsa"]) if xsa_layers else {}
        ve_gates = take(params["ve_gate"].to(lp), reads["ve_gate"])
        qscale = tables.qscale.to(lp)
        G = hp.gate_dims
        lane1, skip, back = None, None, None
        a = v = 0  # index of the next attention layer / value-embedding gate
        one = hp.one_stream
        start, last = lane0, hp.num_layers - 1  # --mudd: the stream before layer 0; the layer MUDD gates
        gates = before_last = None
        if hp.mudd:
            mudd_w = [params[k].to(lp).unbind(0) for k in ("mudd_w1", "mudd_w2", "mudd_bias")]
        for i in range(hp.num_layers):
            if i == hp.parallel_start and not one:
                lane1 = lane0
            if i == hp.skip_to:  # the record's gate: sigmoid(skip_lambda) * 2 * sigmoid(x0[t, :G] . skip_gate)
                gate = torch.sigmoid(skip_lambda).to(x0.dtype) * 2 * torch.sigmoid(
                    x0[:, :G] @ params["skip_gate"].to(x0.dtype).T)  # (T, 1)
                lane0 = lane0 + gate * skip
                lane1 = None if lane1 is None else lane1 + gate * skip
            # (residual weight, (lane 0's, lane 1's output weight)) of the attention and the MLP: the layer's
            # lambdas (None where unread), or at layer L-1 with --mudd the per-token ones (T, 1) from mudd_layer
            weights = ([(resid.get(2 * i + s), (post.get(2 * i + s), post.get(2 * L + 2 * i + s))) for s in (0, 1)]
                       if gates is None else
                       ((gates.resid_attn, (gates.post_attn, None)), (gates.resid_mlp, (gates.post_mlp, None))))
            if i not in hp.no_attn_layers:
                kind = "long" if i in hp.long_window_layers else "short"
                t = hp.ve_tables[i]
                ve, ve_gate = (ves[t], ve_gates.get(v)) if t >= 0 else (None, None)
                v += t >= 0
                src = back if one and back is not None else lane0  # --one-stream: after backout_layer, its output
                if i in paired:
                    out = attn(src, *attn_w[a], attn_gates[a], ve, ve_gate, tables.paired_cos,
                               tables.paired_sin, qscale, seq2, windows[kind], paired=True)
                else:
                    # the public record offsets the keys in its long-window layers (never paired there)
                    ko = hp.key_offset and i in hp.long_window_layers
                    out = attn(src, *attn_w[a], attn_gates[a], ve, ve_gate, tables.cos,
                               tables.sin, qscale, seq, windows[kind], key_offset=ko, bos=bos,
                               xsa=xsa[i] if i in xsa_layers else None,
                               v_add=None if gates is None else gates.v_add,
                               ve_gate_out=None if gates is None else gates.ve_gate)
                a += 1
                if gates is None:
                    inject = x0_lams[i] * x0
                    if big is not None and i > 0:  # layer 0's bigram is in the prelude
                        inject = inject + b_lams[i] * big
                else:  # --mudd, layer L-1: per-token weights; x0 is the stream's start here
                    inject = gates.x0 * start + (0 if big is None else gates.bigram * big)
                lane0, lane1 = attn_residual(lane0, lane1, out, inject, *weights[0], weighted=one)
            if i == hp.skip_from and not one:
                skip = lane0
            out = mlp(lane0 if lane1 is None else lane1, mlp_w[2 * i], mlp_w[2 * i + 1])
            lane0, lane1 = mlp_residual(lane0, lane1, out, *weights[1])
            if i == hp.skip_from and one:
                skip = lane0
            if i == hp.backout_layer:
                back = lane0
            if hp.mudd and i == last - 1:
                before_last = lane0
                lane0, gates = mudd_layer(lane0, start, back, *(w[0] for w in mudd_w), hp.num_heads)
        x = lane0 if lane1 is None else (lane0 + lane1) * 0.5
        if hp.mudd:
            x = mudd_final(x, (start, back, before_last, ves[0], skip), *(w[1] for w in mudd_w))
        elif hp.backout:
            # Back out what the first layers wrote for later context rather than for the prediction (public record).
            x = x - backout_lambda * back
        return x

    return layers


@dataclass
class ModelFns:
    """The model's functions on one device. train_step and val_step are what a run calls (compiled, with
    compile_model, as one region each); layers and loss are their eager parts (evaluation calls layers, tests call
    loss alone)."""
    lookup: object  # embedding lookup (kernels.embedding.embedding on CUDA, cpu_embedding on the CPU)
    layers: object  # layers(params, e, ves, big, ids, cu, tables) -> residual (T, C)
    loss: object  # the training head: (x, lm_head, targets, weights, head8=None) -> loss (head8: head_operands)
    train_step: object  # (params, e, ves, big, ids, cu, targets, tables, mtp weights, head8=None) -> training loss
    val_step: object  # (params, e, ves, big, ids, cu, targets, tables) -> mean next-token CE, head in params' dtype
    head_path: str = ""  # which LM-head matmul the training loss uses, and why (logged)
    embed_accs: bool = False  # training lookups add into the optimizer's accumulators (hp.embed_grad_to_acc, CUDA)
    embed_path: str = ""  # where the embedding tables' gradients go (logged)
    mlp_path: str = ""  # which MLP sublayer runs, and why (logged)
    # lm_head -> what the training head multiplies besides x: the FP8 head's e4m3 copies of the head
    # (kernels.cross_entropy.Fp8Weights), made once per optimizer step by Trainer.train_step; None without it
    head_operands: object = lambda lm_head: None
    compile_path: str = ""  # torch.compile's options beyond record #74's, if any (logged)


def build_fns(hp, device, compile_model, attention="auto", precompiled=None):
    """The model functions on ``device``, and the log's lines saying which paths they take. attention: "auto"
    (FlashAttention on CUDA, dense SDPA on the CPU) or "dense" (tests). With compile_model (CUDA), train_step and
    val_step are each one compiled region (the module docstring's Compilation). The FP8 head is chosen here, once:
    hp.fp8_head and fp8_head_support(device), else the matmul in the parameters' dtype (always in val_step).
    precompiled (with compile_model: --compile-cache's folder for this run's graphs): train_step and val_step are
    compilation.Precompiled, whole compiled functions loaded from there or compiled ahead of time and saved."""
    attend = flash_attend if device.type == "cuda" and attention == "auto" else dense_attend
    ce = softcapped_cross_entropy if device.type == "cuda" else softcapped_cross_entropy_ref
    ok, why = fp8_head_support(device)
    fp8 = hp.fp8_head and ok
    grad_in_fwd = hp.ce_grad_in_forward and device.type == "cuda"
    fused_mlp = hp.fused_mlp and device.type == "cuda" and hp.param_dtype == "bfloat16"
    mlp = fused_mlp_sublayer if fused_mlp else mlp_sublayer
    if fused_mlp:
        register_mlp_ops()  # before anything compiles relu2_mlp (kernels.mlp.register_ops)
    if fused_mlp and hp.mlp_act_only:
        def mlp(x, w_fc, w_proj_t):  # --mlp-act-only
            return fused_mlp_sublayer(x, w_fc, w_proj_t, act_only=True)
    layers = make_layers(hp, attend, mlp)

    # The head's closures hold the float softcap, not hp: a function saved by --compile-cache whose guards reach hp
    # through two closures (layers' and val_loss') does not load (dynamo keeps only one of the two paths).
    softcap = hp.softcap

    def loss(x, w, t, wk, head8=None):
        return head_loss(x, w, t, wk, softcap, ce, fp8, grad_in_fwd, head8)

    def head_operands(lm_head):
        return fp8_head_weights(lm_head, FP8_W_S) if fp8 else None

    def val_loss(x, w, t, wk):
        return head_loss(x, w, t, wk, softcap, ce, False)

    prefix = prefix_token_table(load_gpt2(), hp.vocab_size).to(device) if hp.prefix_loss else None

    def train_step(params, e, ves, big, ids, cu, targets, tables, wk, head8=None):
        if prefix is not None:  # --prefix-loss: (2, T) targets, each next token's prefix token second (-1: none)
            targets = torch.stack([targets, prefix[targets]])
        return loss(layers(params, e, ves, big, ids, cu, tables), params["lm_head"], targets, wk, head8)

    def val_step(params, e, ves, big, ids, cu, targets, tables):
        one = torch.ones(1, dtype=torch.float32, device=ids.device)
        return val_loss(layers(params, e, ves, big, ids, cu, tables), params["lm_head"], targets, one)

    steps = [train_step, val_step]
    options = None
    if compile_model:  # --cpp-wrapper: inductor options for the training step only (validation is not timed)
        options = cpp_wrapper_options() if hp.cpp_wrapper else None
        steps = [torch.compile(f, fullgraph=True, dynamic=False, options=o) for f, o in
                 ((train_step, options), (val_step, None))]
        if precompiled is not None:
            steps = [Precompiled(f, f.__name__, precompiled, compiled, o) for f, compiled, o in
                     ((train_step, steps[0], options), (val_step, steps[1], None))]
    lookup = embedding if device.type == "cuda" else cpu_embedding
    # The accumulate mode is kernels.embedding's; the CPU's torch lookup has none (the flag changes nothing there).
    embed_accs = hp.embed_grad_to_acc and device.type == "cuda"
    head_path, embed_path, mlp_path, compile_path = path_lines(hp, device, fp8, why, grad_in_fwd, fused_mlp, embed_accs,
                                                               compile_model, options, precompiled is not None)
    return ModelFns(lookup, layers, loss, *steps, head_path=head_path, embed_accs=embed_accs, embed_path=embed_path,
                    mlp_path=mlp_path, head_operands=head_operands, compile_path=compile_path)


class ModelInputs(NamedTuple):
    """The arguments of fns.layers (in this order); train_step and val_step take the targets before tables."""
    params: dict  # the parameters read inside the compiled region (PARAMS' region rows)
    e: torch.Tensor  # (T, C) token embeddings
    ves: list  # [(T, C)] value embeddings, one per table
    big: Optional[torch.Tensor]  # (T, C) bigram embeddings (None with --no-bigram)
    ids: torch.Tensor  # (T,) int32
    cu: torch.Tensor  # (n_docs + 1,) int32 document boundaries on the device, a dynamic dimension
    tables: AttnTables


def model_inputs(hp, params, fns, batch, windows, rot_cache, yarn_long=None, accs=None, dynamic=False):
    """The model's one entry, for training, validation, evaluation and sampling alike: the ModelInputs of the
    micro-batch ``batch`` at windows (short, long) in blocks; what the loader did not prepare (None) is made here
    from the ids. yarn_long: see attn_tables. accs: see embed_inputs (the training step's only). dynamic
    (--dynamic-tokens' training step): every input of T rows, batch.targets included, marked dynamic
    (mark_tokens_dynamic; the tables' in attn_tables)."""
    ids = batch.ids
    tables = attn_tables(hp, ids.numel(), windows, rot_cache, ids.device, batch.max_len, yarn_long, dynamic)
    e, ves, big = embed_inputs(hp, params, ids, fns.lookup, batch.prep, batch.bigram, batch.bigram_prep, accs)
    if dynamic:
        mark_tokens_dynamic(e, *ves, big, ids, batch.targets)
    cu = doc_cu_seqlens(ids, hp.bos_id) if batch.cu_seqlens is None else batch.cu_seqlens
    cu = cu.to(ids.device, non_blocking=True)  # the number of documents: a dynamic dimension (any count, one graph)
    torch._dynamo.mark_dynamic(cu, 0)
    region = {k: params[k] for k in PARAMS if PARAMS[k].region}  # the embedding tables: read by the lookups
    return ModelInputs(region, e, ves, big, ids, cu, tables)


def forward(hp, params, fns, batch, windows, rot_cache, train, mtp=None, yarn_long=None, accs=None, head8=None):
    """Loss of one micro-batch (a 0-d fp32 tensor): with train, train_step's (head_loss with the multi-token
    weights mtp, (K,) fp32 on the device; head8: fns.head_operands of the current head, None: made here), else
    val_step's (the mean next-token CE). yarn_long: see attn_tables. accs: see embed_inputs. With --dynamic-tokens
    the training step's inputs are marked dynamic (model_inputs); val_step keeps its one static length."""
    x = model_inputs(hp, params, fns, batch, windows, rot_cache, yarn_long, accs, dynamic=train and hp.dynamic_tokens)
    if train:
        assert mtp is not None, "forward(train=True) needs the step's multi-token weights (mtp)"
        head8 = fns.head_operands(params["lm_head"]) if head8 is None else head8
        return fns.train_step(x.params, x.e, x.ves, x.big, x.ids, x.cu, batch.targets, x.tables, mtp, head8)
    return fns.val_step(x.params, x.e, x.ves, x.big, x.ids, x.cu, batch.targets, x.tables)


# -----------------------------------------------------------------------------
# Optimizer: sharded NorMuon (banks) + fused AdamW (the rest), fp32 accumulation, reduce-scatter / all-gather


class Group:
    """One parameter (spec: its PARAMS row): its fp32 gradient accumulator (rows padded to a multiple of the world
    size) and this rank's optimizer shard, rows lo .. lo + shard_rows. blocks (Muon, --muon-qk-pairs' attn_bank):
    the matrices whose global index modulo 4 is 0 or 1 (W_q, W_k) are each split into ``blocks`` row blocks (pairs
    of heads) that NorMuon takes as matrices of their own; ``split`` then holds (their rows, the other rows) of my
    shard, and their momentum and second moment are kept apart, in the blocks' shape (mom_blocks, v2_blocks)."""

    def __init__(self, name, param, d, blocks=0):
        self.name, self.param, self.spec = name, param, PARAMS[name]
        self.blocks = blocks
        self.muon = self.spec.optim == "muon"
        self.slow = self.spec.optim == "adam" and self.spec.slow
        self.rows = param.shape[0]
        self.rows_pad = -(-self.rows // d.world) * d.world
        self.shard_rows = self.rows_pad // d.world
        self.lo = d.rank * self.shard_rows
        # world size 1: the kernels update a parameter with a master (bf16 matrices, the banks) in place
        self.in_place = self.shard_rows == self.rows and (self.muon or param.dtype != torch.float32)
        self.acc = torch.zeros((self.rows_pad, *param.shape[1:]), dtype=torch.float32, device=param.device)
        self.gathered = (param.data if self.rows_pad == self.rows else
                         torch.zeros((self.rows_pad, *param.shape[1:]), dtype=param.dtype, device=param.device))
        self.split = None
        if blocks:
            idx = torch.arange(self.lo, self.lo + self.shard_rows)
            qk = (idx % 4 < 2) & (idx < self.rows)
            self.split = tuple(torch.nonzero(m).flatten().to(param.device) for m in (qk, ~qk))
        self.reset_state()

    def shard_of(self, full):
        """My rows of a full (unpadded) tensor, zero-padded to shard_rows rows, fp32."""
        out = torch.zeros((self.shard_rows, *full.shape[1:]), dtype=torch.float32, device=full.device)
        hi = min(self.lo + self.shard_rows, self.rows)
        if hi > self.lo:
            out[:hi - self.lo] = full[self.lo:hi].float()
        return out

    def reset_state(self):
        p = self.param.detach()
        self.master = self.shard_of(p)  # fp32 master of my rows
        self.sync_shard_param()
        self.step = 0
        if self.muon:
            M, N = p.shape[1:]
            other = self.shard_rows if self.split is None else len(self.split[1])
            self.mom = torch.zeros((other, M, N), dtype=torch.float32, device=p.device)
            self.v2 = second_moment(other, M, N, p.device)
            if self.split is not None:
                k = len(self.split[0]) * self.blocks
                self.mom_blocks = torch.zeros((k, M // self.blocks, N), dtype=torch.float32, device=p.device)
                self.v2_blocks = second_moment(k, M // self.blocks, N, p.device)
        else:
            self.exp_avg = torch.zeros_like(self.master)
            self.exp_avg_sq = torch.zeros_like(self.master)

    def sync_shard_param(self):
        """The parameter-dtype copy of my rows that is all-gathered (fp32 Adam rows: the master itself; in_place:
        the parameter, which holds the master rounded wherever a master is set, so the gather copies nothing)."""
        self.shard_param = self.param.data if self.in_place else self.master.to(self.param.dtype, copy=self.muon)

    def state_tensors(self):
        keys = ("master", "mom", "v2") if self.muon else ("master", "exp_avg", "exp_avg_sq")
        if self.split is not None:
            keys += ("mom_blocks", "v2_blocks")
        return {k: getattr(self, k) for k in keys}


def second_moment(k, M, N, device):
    """NorMuon's second-moment state of k (M, N) matrices: per row (k, M, 1) when M >= N, else per column."""
    return torch.zeros((k, M, 1) if M >= N else (k, 1, N), dtype=torch.float32, device=device)


class StepPlan(NamedTuple):
    """What the optimizer does at one step: a function of the step number and the tables (step_plan)."""
    tied: bool  # a PARAMS row with tied_to is its partner's transpose (before untie_step)
    groups: tuple  # the rows that step, in PARAMS order: the slow Adam rows only at a slow Adam step
    early: frozenset  # the rows whose reduce-scatter the last backward starts once their gradient is complete


def step_plan(hp, step, embed_accs=False):
    """The StepPlan of training step ``step``. While tied, a tied row's gradient goes to its partner, so its own
    reduce-scatter never starts, and the partner's waits for both gradients. embed_accs (ModelFns.embed_accs): the
    embedding lookups add the tables' gradients (PARAMS' rows outside the region) into their accumulators, complete
    only after the backward, so their reduce-scatters (and a tied partner's) start in Optimizer.step instead."""
    slow = slow_adam_step(hp, step)
    tied = step < untie_step(hp)
    groups = tuple(n for n, p in PARAMS.items() if slow or p.optim == "muon" or not p.slow)
    late = {n for n, p in PARAMS.items() if embed_accs and not p.region}
    if tied:
        late |= {n for n, p in PARAMS.items() if p.tied_to} | {p.tied_to for n, p in PARAMS.items() if n in late}
    return StepPlan(tied, groups, frozenset(groups) - late)


class LastBackward(NamedTuple):
    """The runtime state of a step's last backward: its plan, the reduce-scatters its hooks started (name -> (work,
    shard)) and the tied rows whose gradients are complete."""
    plan: StepPlan
    started: dict
    complete: set


class Optimizer:
    """Sharded NorMuon (the banks) and AdamW (the rest) over the parameters of PARAMS, one Group each.

    Per step: the backward of every micro-step (the hooks fold each gradient into its group's fp32 accumulator),
    last_backward(plan) ahead of the last one, then step(plan). With hp.embed_grad_to_acc (CUDA) the embedding
    lookups add their gradients straight into the accumulators (embedding_accs(): bitwise the hooks' fold of the
    dense gradient) and leave the tables' .grad None. untie() gives the tied row (PARAMS' tied_to) its own state."""

    def __init__(self, hp, params, d):
        self.hp, self.d = hp, d
        self.kernels = StepKernels.on(d.device)
        pairs = hp.num_heads // 2 if hp.muon_qk_pairs else 0  # --muon-qk-pairs: W_q, W_k as H/2 blocks each
        self.groups = {n: Group(n, params[n], d, blocks=pairs if n == "attn_bank" else 0) for n in PARAMS}
        self.tie = next((n, p.tied_to) for n, p in PARAMS.items() if p.tied_to)  # (the tied row, its partner)
        self._embedding_accs = None  # embedding_accs(), made on first use
        self.tied = True  # the tied row has no optimizer state of its own (untie() gives it one)
        self.pending = False  # the slow groups' accumulators hold the gradients of steps they skipped
        self.last = None  # LastBackward during a step's last backward, until step()
        for g in self.groups.values():
            g.param.register_post_accumulate_grad_hook(lambda p, g=g: self._grad_ready(g))
        for g in self.groups.values():
            if g.muon:  # per-matrix lr multiplier of my rows: odd global indices are W_proj^T with proj
                idx = torch.arange(g.lo, g.lo + g.shard_rows, device=d.device)
                g.lr_mul = torch.where(idx % 2 == 1, hp.mlp_proj_lr_mul if g.spec.proj else 1.0, 1.0).float()

    def embedding_accs(self):
        """Views of the embedding tables' fp32 accumulators (padding rows left out), for embed_inputs' accs: made
        once (no view ops on the hot path), as the accumulators are only ever changed in place."""
        if self._embedding_accs is None:
            hp, g = self.hp, self.groups
            ve = g["value_embeds"]
            self._embedding_accs = {
                "embed": g["embed"].acc[:g["embed"].rows],
                "value_embeds": ve.acc[:ve.rows].view(hp.num_ve, hp.vocab_size, hp.model_dim).unbind(0),
                "bigram_embed": g["bigram_embed"].acc[:g["bigram_embed"].rows]}
        return self._embedding_accs

    def _fold_tied(self):
        """Add the tied row's accumulated gradient, transposed, into its partner's."""
        tied, partner = (self.groups[n] for n in self.tie)
        self.kernels.transpose_add(tied.acc[:tied.rows], partner.acc[:partner.rows])

    @torch.no_grad()
    def _grad_ready(self, g):
        """Post-accumulate-grad hook, once per backward when g's gradient is complete: acc += grad (one fp32
        rounding of each bf16 partial). In the last backward g's reduce-scatter starts if the plan has it early;
        while tied, the partner's waits for both gradients (the tied row's added to it first)."""
        if g.param.grad is None:
            return
        self.kernels.accumulate(g.acc[:g.rows], g.param.grad)
        g.param.grad = None
        if self.last is None:
            return
        plan, started, complete = self.last
        if plan.tied and g.name in self.tie:
            complete.add(g.name)
            if len(complete) < 2 or self.tie[1] not in plan.early:
                return
            self._fold_tied()
            g = self.groups[self.tie[1]]
        elif g.name not in plan.early:
            return
        started[g.name] = reduce_scatter_sum(self.d, g.acc)

    def last_backward(self, plan):
        """Before the last micro-step's backward: the plan's early reduce-scatters start during it."""
        self.last = LastBackward(plan, {}, set())

    def reset(self):
        self.tied = True
        self.pending = False
        self.last = None
        for g in self.groups.values():
            g.acc.zero_()
            g.reset_state()

    def untie(self):
        """Give the tied row its partner's (transposed) Adam state, then update both separately."""
        tied, partner = (self.groups[n] for n in self.tie)
        if self.pending:  # gradients of skipped tied steps: fold the tied row's into its partner's, as a tied step does
            self._fold_tied()
            tied.acc.zero_()
        full = {}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            buf = torch.empty((partner.rows_pad, *partner.param.shape[1:]), dtype=torch.float32, device=self.d.device)
            work = all_gather_rows(self.d, getattr(partner, key), buf)
            if work is not None:
                work.wait()
            full[key] = buf[:partner.rows].T
        for key, t in full.items():
            setattr(tied, key, tied.shard_of(t))
        tied.sync_shard_param()
        tied.step = partner.step
        self.tied = False

    @torch.no_grad()
    def step(self, plan, lr_mul, momentum):
        """One step of plan.groups on their accumulated gradients (the slow Adam groups left out keep summing, not
        averaged, as in the public record). The reduce-scatters the last backward did not start start in PARAMS
        order; the Adam updates wait for all of theirs and run as one fused_adamw_multi_step call, then their
        all-gathers start while Muon works on the banks."""
        d = self.d
        if plan.tied != self.tied or (self.last is not None and self.last.plan != plan):
            raise RuntimeError(f"Optimizer.step: the plan (tied={plan.tied}) is not the optimizer's (tied="
                               f"{self.tied}) or its last backward's")
        started = {} if self.last is None else self.last.started
        self.last = None
        tied, partner = self.tie
        if plan.tied and partner in plan.groups and partner not in started:
            self._fold_tied()
        for name in plan.groups:  # the reduce-scatters the backward did not start, in PARAMS order
            if name not in started and not (plan.tied and name == tied):
                started[name] = reduce_scatter_sum(d, self.groups[name].acc)
        launched = [(self.groups[n], *started[n]) for n in plan.groups if n in started]
        adam = []
        for g, work, grad in launched:
            if not g.muon:
                if work is not None:
                    work.wait()
                adam.append((g, grad))
        self._adam(adam, lr_mul)
        gathers = [(g, all_gather_rows(d, g.shard_param, g.gathered)) for g, _ in adam]
        for g, work, grad in launched:
            if g.muon:
                if work is not None:
                    work.wait()
                self._muon(g, grad, lr_mul, momentum)
                gathers.append((g, all_gather_rows(d, g.shard_param, g.gathered)))
        for g, work in gathers:
            if work is not None:
                work.wait()
            if g.gathered is not g.param.data:
                g.param.data.copy_(g.gathered[:g.rows])
            if plan.tied and g.name == partner:
                self.kernels.transpose_copy(g.param.data, self.groups[tied].param.data)
        for name in plan.groups:
            self.groups[name].acc.zero_()
        self.pending = any(g.slow and n not in plan.groups for n, g in self.groups.items())

    def _adam(self, items, lr_mul):
        """items [(group, fp32 gradient shard)] in one fused_adamw_multi_step call (fp32 rows are their masters)."""
        hp = self.hp
        params, grads, exp_avgs, exp_avg_sqs, masters, hparams = [], [], [], [], [], []
        for g, grad in items:
            (b1, b2), wd_mul = g.spec.betas, g.spec.wd_mul
            lr = hp.adam_lr * g.spec.lr_mul * lr_mul
            g.step += 1
            fp32 = g.shard_param.dtype == torch.float32  # fp32 parameters: the master is the parameter shard
            params.append(g.master if fp32 else g.shard_param)
            masters.append(None if fp32 else g.master)
            grads.append(grad)
            exp_avgs.append(g.exp_avg)
            exp_avg_sqs.append(g.exp_avg_sq)
            hparams.append(dict(lr=lr, beta1=b1, beta2=b2, eps=hp.adam_eps, weight_decay=hp.adam_wd * wd_mul * lr,
                                step=g.step))
            if fp32:
                g.shard_param = g.master
        if params:  # the record's cautious decay: only where the step already shrinks the parameter
            self.kernels.adam(params, grads, exp_avgs, exp_avg_sqs, masters, hparams, cautious_wd=True)

    def _muon(self, g, grad, lr_mul, momentum):
        if g.split is None:
            self._muon_matrices(grad, g.mom, g.v2, g.master, g.lr_mul, g.shard_param, lr_mul, momentum)
            return
        # --muon-qk-pairs: my W_q / W_k rows as blocks (a view of their copies), the others as they are; masters
        # and parameter rows copied out, updated, and written back in place
        for rows, mom, v2, blocks in ((g.split[0], g.mom_blocks, g.v2_blocks, g.blocks), (g.split[1], g.mom, g.v2, 1)):
            if not len(rows):
                continue
            shape = (len(rows) * blocks, g.param.shape[1] // blocks, g.param.shape[2])
            master, param = g.master[rows].view(shape), g.shard_param[rows].view(shape)
            self._muon_matrices(grad[rows].view(shape), mom, v2, master, g.lr_mul[rows].repeat_interleave(blocks),
                                param, lr_mul, momentum)
            g.master[rows] = master.view(-1, *g.param.shape[1:])
            g.shard_param[rows] = param.view(-1, *g.param.shape[1:])

    def _muon_matrices(self, grad, mom, v2, master, lr_muls, param_out, lr_mul, momentum):
        """NorMuon on k matrices (k, M, N): fp32 gradients, momentum and second moment (state, in place), fp32
        masters and parameter-dtype copies (written in place), per-matrix lr multipliers (k,)."""
        hp = self.hp
        M, N = grad.shape[1:]
        x = self.kernels.momentum(grad, mom, momentum)  # bf16, Frobenius-normalised per matrix
        o = self.kernels.polar(x, normalized=True)  # (k, M, N) bf16, ~orthogonal
        lr = hp.muon_lr * lr_mul * max(1.0, M / N) ** 0.5
        # NorMuon (per-row / per-column second moment, norm-preserving), cautious decay on the fp32 master and
        # the cast to the parameter dtype, fused (kernels.normuon).
        self.kernels.normuon(o, v2, master, lr_muls, param_out, lr=lr, beta2=hp.muon_beta2,
                             wd=hp.muon_wd * hp.muon_lr * lr_mul)

    def state_dict(self):
        """This rank's state; between two slow Adam steps (pending) also the slow groups' accumulators."""
        sd = {"tied": self.tied, "pending": self.pending,
              "groups": {n: {"step": g.step, **{k: v.cpu() for k, v in g.state_tensors().items()}}
                         for n, g in self.groups.items()}}
        if self.pending:
            sd["acc"] = {n: g.acc.cpu() for n, g in self.groups.items() if g.slow}
        return sd

    def load_state_dict(self, sd):
        self.tied = sd["tied"]
        self.pending = sd.get("pending", False)
        for n, acc in sd.get("acc", {}).items():
            self.groups[n].acc.copy_(acc)
        for n, s in sd["groups"].items():
            g = self.groups[n]
            g.step = s["step"]
            for k in g.state_tensors():
                setattr(g, k, s[k].to(self.d.device))
            g.sync_shard_param()


# -----------------------------------------------------------------------------
# Data: BOS-aligned training micro-batches (background thread); validation: Trainer.validate


class TrainLoader(BackgroundLoader):
    """Deterministic stream of global batches; rank r keeps slots r, r+W, ... of each.

    A slot of T tokens is filled with whole documents from consecutive BOS positions, each cut to the stage's
    max_doc_len and to the room left (T + 1 tokens: inputs and shifted targets). A document cut short is not
    resumed: the next slot starts at the next BOS. When a shard cannot fill a whole global batch the stream moves
    to the next shard (cycling through the files). State = {shard index, BOS index, epoch, step}: where the next
    batch starts and the step it is for (the schedule's micro-batch length and max_doc_len).
    The background thread (BackgroundLoader) prepares the next step's batch (pinned tensors + embedding prep).
    """

    def __init__(self, hp, files, d, micro_tokens_at):
        super().__init__(files, hp.bos_id, d.device)
        self.hp, self.d = hp, d
        self.micro_tokens_at = micro_tokens_at  # step -> T
        self.rewind(0)

    def _plan(self, state, T, max_doc_len):
        """Slot spans [(start, end), ...] per slot for the global batch at `state`; returns (spans, new state)."""
        s = dict(state)
        for _ in range(2 * len(self.files) + 1):
            tokens, bos = self._shard(s["shard"])
            spans, j, ok = [], s["bos"], True
            for _slot in range(SLOTS):
                slot, room = [], T + 1
                while room > 0:
                    if j >= len(bos):
                        ok = False
                        break
                    start = bos[j]
                    stop = bos[j + 1] if j + 1 < len(bos) else len(tokens)
                    n = min(stop - start, max_doc_len, room)
                    slot.append((int(start), int(start + n)))
                    room -= n
                    j += 1
                if not ok:
                    break
                spans.append(slot)
            if ok:
                s["bos"] = j
                return spans, s
            s["shard"], s["bos"] = (s["shard"] + 1) % len(self.files), 0
            s["epoch"] += s["shard"] == 0
        raise ShardError(f"training shards {[str(f) for f in self.files]} hold too few documents for one batch "
                         f"of {SLOTS} x {T + 1} tokens")

    def _build(self, state):
        step = state["step"]
        T, max_doc_len = self.micro_tokens_at(step), stage_at(self.hp, step)[1].max_doc_len
        spans, new_state = self._plan(state, T, max_doc_len)
        new_state["step"] = step + 1
        tokens = self._shard(new_state["shard"])[0]  # the spans lie in the shard the plan ended in
        micro = []
        for slot in spans[self.d.rank::self.d.world]:
            buf = np.concatenate([tokens[a:b] for a, b in slot]).astype(np.int64)
            ids = torch.from_numpy(buf[:-1].astype(np.int32))
            mb = MicroBatch(ids, torch.from_numpy(buf[1:]), prepare_ids(ids, self.hp.vocab_size),
                            doc_cu_seqlens(buf[:-1], self.hp.bos_id), max_len=max_doc_len)
            if self.hp.bigram:  # hashed and sorted here, off the training thread: no device work, no sync
                mb.bigram = bigram_hash(ids, self.hp.bigram_vocab_size, self.hp.bos_id)
                mb.bigram_prep = prepare_ids(mb.bigram, self.hp.bigram_vocab_size)
            micro.append(mb.pack(pin=self.d.device.type == "cuda"))
        return micro, new_state

    def rewind(self, step):
        """Back to the first document of the first shard, with the schedule at ``step`` (the warmup and the
        profiler run each stage's start on the first documents; the timed run starts from step 0)."""
        self.load_state({"shard": 0, "bos": 0, "epoch": 0, "step": step})


# -----------------------------------------------------------------------------
# Training


class Trainer:
    """State of one run: parameters, optimizer, loader, compiled functions; train_step / validate."""

    def __init__(self, hp, d, train_files, val_files, lap=lambda phase: None, precompiled=None):
        self.hp, self.d = hp, d
        self.accum = check_world_size(d.world)
        # The parameters are drawn on a second thread while build_fns imports and wraps the compiler (each a few
        # seconds on a GPU host): torch's ops release the GIL, and init_params draws from its own generator, so the
        # values are those of a serial start.
        with ThreadPoolExecutor(1, thread_name_prefix="init_params") as pool:
            drawn = pool.submit(init_params, hp, d.device, hp.seed)
            self.fns = build_fns(hp, d.device, hp.compile, precompiled=precompiled)
            self.params = drawn.result()
        self.initial = {k: v.detach().clone() for k, v in self.params.items()}
        lap("parameters and model functions")
        self.opt = Optimizer(hp, self.params, d)
        lap("optimizer")
        self.loader = TrainLoader(hp, train_files, d, lambda s: micro_tokens_at(hp, s))
        self.val_tokens = load_shard(val_files[0], mmap=True)
        # Validation: whole global micro-batches of val_micro_tokens (+1), a multiple of SLOTS.
        T = hp.val_micro_tokens
        self.val_micro = min(hp.val_tokens, len(self.val_tokens) - 1) // T // SLOTS * SLOTS
        if self.val_micro == 0:
            raise ShardError(f"validation shard has {len(self.val_tokens)} tokens, fewer than {SLOTS} micro-batches "
                             f"of {T} (+1) tokens")
        self.rot_cache = {}
        # The head's weights of every step (loss_weights_at: the multi-token ones, then --prefix-loss's) as device
        # tensors, made once (a per-step copy could block), the multi-token ones zero-padded to the stage table's
        # longest list: a weight of 0 adds nothing to the loss or its gradient, and one length for every stage
        # keeps the compiled region's inputs the same but for the micro-batch length.
        K = max(len(mtp_weights_at(hp, s)) for s in range(hp.total_steps))
        self.mtp = [torch.tensor(loss_weights_at(hp, s, K), dtype=torch.float32, device=d.device)
                    for s in range(hp.total_steps)]
        # --hellaswag-every: examples rendered and packed once, scored by the eager model (sequence_logits)
        self.hellaswag = HellaSwag(hp, d, BLOCK) if hp.hellaswag_every > 0 else None
        lap("loaders")

    def reset(self):
        """Back to the initial state (after the compile warmup)."""
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(self.initial[k])
                v.grad = None
        self.opt.reset()
        self.loader.rewind(0)

    def train_step(self, step, want_loss, clock=None):
        """One optimizer step over this rank's micro-batches. Returns the global batch's mean loss (a float) if
        want_loss, else None. clock: a run_log.StepClock (the timed loop's): the host waits for the previous step
        once this step's first micro-batch is queued, the loss goes to the clock, and None is returned."""
        hp = self.hp
        plan = step_plan(hp, step, self.fns.embed_accs)
        if self.opt.tied and not plan.tied:  # the first untied step: the embedding gets its own optimizer state
            self.opt.untie()
        windows = windows_at(hp, step)
        total = None
        mbs = self.loader.next()
        head8 = self.fns.head_operands(self.params["lm_head"])  # the head changes only in opt.step, below
        for i, mb in enumerate(mbs):
            if i == len(mbs) - 1:  # complete gradients start their reduce-scatter inside this backward
                self.opt.last_backward(plan)
            loss = self.micro_step(step, mb, windows, head8)
            if want_loss:
                total = loss.detach() if total is None else total + loss.detach()
            if i == 0 and clock is not None:
                clock.wait()  # the previous step's end, while the device runs this first micro-batch
        with torch.profiler.record_function("optimizer_step"):  # a named GPU range in --profile-steps traces
            self.opt.step(plan, lr_factor(hp, step), muon_momentum(hp, step))
        if want_loss and self.d.world > 1:
            dist.all_reduce(total)
        if clock is not None:
            clock.queued(step, total)
            return None
        return total.item() if want_loss else None

    def micro_step(self, step, mb, windows, head8):
        """Forward and backward of one training micro-batch of ``step``; returns its loss / SLOTS. The optimizer's
        hooks move each gradient into its fp32 accumulator; with --embed-grad-to-acc (CUDA) the embedding tables'
        backward adds straight into theirs."""
        accs = self.opt.embedding_accs() if self.fns.embed_accs else None
        loss = forward(self.hp, self.params, self.fns, mb, windows, self.rot_cache, train=True, mtp=self.mtp[step],
                       accs=accs, head8=head8) / SLOTS
        loss.backward()
        return loss

    def launch_probe(self, step, hold_ms=300.0):
        """(host ms, device ms) of one training micro-batch of ``step``, CUDA only: its forward and backward are
        queued while the device is held busy (torch.cuda._sleep), so the host's time to queue their kernels and
        the device's time to run them back to back come apart. Where the host is the slower, the steps of that
        length wait on the host. A queueing longer than hold_ms shows in the device time too. The gradients go
        into the accumulators (launch_probes resets them) and no collective starts."""
        self.loader.rewind(step)
        mb = self.loader.next()[0]
        head8 = self.fns.head_operands(self.params["lm_head"])
        first, last, unit = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda._sleep(10 ** 6)  # the hold's length in cycles: this device's ms per million cycles
        unit.record()
        torch.cuda._sleep(10 ** 6)
        first.record()
        first.synchronize()
        cycles = int(hold_ms / max(unit.elapsed_time(first), 1e-3) * 10 ** 6)
        torch.cuda._sleep(cycles)
        first.record()
        t0 = time.perf_counter()
        self.micro_step(step, mb, windows_at(self.hp, step), head8)
        host = (time.perf_counter() - t0) * 1e3  # before the end event is queued: its device time cannot precede it
        last.record()
        last.synchronize()
        return host, first.elapsed_time(last)

    @torch.no_grad()
    def validate(self, windows, max_micro=None, yarn_long=None):
        """Mean validation loss over contiguous chunks of val_micro_tokens (+1) tokens: rank r takes r, r+W, ..."""
        hp, d, T = self.hp, self.d, self.hp.val_micro_tokens
        n = self.val_micro if max_micro is None else min(self.val_micro, max_micro * d.world)
        total = torch.zeros((), dtype=torch.float32, device=d.device)
        for m in range(d.rank, n, d.world):
            buf = torch.from_numpy(np.asarray(self.val_tokens[m * T:m * T + T + 1]).astype(np.int64))
            mb = MicroBatch(buf[:-1].to(torch.int32).to(d.device), buf[1:].to(d.device), None,
                            doc_cu_seqlens(buf[:-1], hp.bos_id).to(d.device))
            total += forward(hp, self.params, self.fns, mb, windows, self.rot_cache, train=False, yarn_long=yarn_long)
        if d.world > 1:
            dist.all_reduce(total)
        return (total / n).item()


def warmup_stages(hp):
    """[(stage index, first step, micro-batch length T)]: the first stage of each micro-batch length, in the compile
    warmup's order: the schedule's, or with --dynamic-tokens the longest first (inductor takes its kernels' size
    hints from the length it compiles at and picks each kernel's configuration once, at its first launch, and the
    longest stages take most of a run's time)."""
    out, seen = [], set()
    for i, (start, end, _) in enumerate(stage_bounds(hp)):
        T = micro_tokens_at(hp, start)
        if start < end and T not in seen:  # a stage of an earlier one's length: its windows and YaRN tables are
            seen.add(T)                    # tensor arguments of the same graph
            out.append((i, start, T))
    if hp.dynamic_tokens:
        out.sort(key=lambda s: -s[2])
    return out


def graph_name(T=None):
    """A compiled graph's name in ahead_graphs, the warmup's waits and the log: the training step at micro-batch
    length T, or (None) the validation step."""
    return "validation step" if T is None else f"training step T={T}"


def ahead_graphs(hp, device):
    """The graphs a compiling run has second processes compile meanwhile (compile_ahead): each training micro-batch
    length but the one the warmup compiles first (one graph in all with --dynamic-tokens), as "training step T=...",
    then "validation step"; [(name, first step or None)]. The training ones only on a GPU of AHEAD_TRAINING_GIB or
    more: each such process holds the parameters, the optimizer and one training micro-step's activations."""
    train = [] if hp.dynamic_tokens else [(graph_name(T), start) for _, start, T in warmup_stages(hp)[1:]]
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < AHEAD_TRAINING_GIB * 2**30:
        train = []
    return train + [(graph_name(), None)]


def ahead_frames(hp, names):
    """The compile_report frames of the graphs named ``names`` (ahead_graphs' names, compiled by second processes):
    train_step compiles first, one frame per warmup_stages length in the warmup's order ([0/k]), then val_step."""
    keys = {f"train_step [0/{k}]" for k, (_, _, T) in enumerate(warmup_stages(hp)) if graph_name(T) in names}
    return frozenset(keys | ({"val_step [1/0]"} if graph_name() in names else set()))


def warmup(trainer, log=None, ahead=lambda name: None):
    """Untimed, so that compilation and every kernel's first launch happen before the clock: a training step of
    every micro-batch shape (warmup_stages; the first stage's with and without the slow Adam groups; with
    --dynamic-tokens only the first compiles, the others run for their first launches), the untie and an untied
    slow step, a validation micro-batch and (--hellaswag-every) a HellaSwag pack; then a full state reset. Before a
    graph that a second process compiled meanwhile (ahead_graphs, compile_ahead), ahead(name) waits for it.
    Returns [(phase, seconds)], each also logged as it ends (``compile_phase:``)."""
    hp, cuda = trainer.hp, trainer.d.device.type == "cuda"
    phases = []

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        phases.append((name, time.perf_counter() - t0))
        if log is not None:
            log(f"compile_phase: {name}: {phases[-1][1]:.1f} s")

    bounds = stage_bounds(hp)
    for i, start, T in warmup_stages(hp):
        trainer.loader.rewind(start)
        steps = range(start, min(start + (hp.adam_every if i == 0 else 1), bounds[i][1]))
        for k, t in enumerate(steps):  # the first stage also steps once with and once without the slow Adam groups
            def step(t=t, first=k == 0):
                if first:
                    ahead(graph_name(T))
                trainer.train_step(t, want_loss=False)
            timed(f"stage{i} T={T} step {t}", step)
    # An untied slow step (the last stage's first, or the first after the untie): the untie and the untied Adam
    # update (the embedding its own tensor) run once too.
    start = max(untie_step(hp), bounds[-1][0])
    last = next((s for s in range(start, hp.total_steps) if slow_adam_step(hp, s)), None)
    if trainer.opt.tied and last is not None:
        trainer.loader.rewind(last)
        timed(f"untie + untied step {last}", lambda: trainer.train_step(last, want_loss=False))

    def validation():
        ahead(graph_name())
        trainer.validate(windows_at(hp, hp.total_steps - 1), max_micro=1)
    timed(f"validation T={hp.val_micro_tokens}", validation)
    if trainer.hellaswag is not None:  # the first HellaSwag pack: the evaluation's first kernel launches
        hs = trainer.hellaswag
        model = model_logits(hp, trainer.params, trainer.fns, trainer.rot_cache)
        timed("hellaswag pack", lambda: hellaswag_scores(model, hs.packs[:1], len(hs.labels), trainer.d.device))
    trainer.reset()
    if cuda:
        torch.cuda.synchronize()
    return phases


def launch_probes(trainer, log):
    """--profile-steps on CUDA, after the warmup: one ``launch_probe:`` line per micro-batch length, from the first
    step of the first stage of that length (Trainer.launch_probe: is the host or the device the slower there?),
    then a full state reset."""
    hp, seen = trainer.hp, set()
    for i, (start, end, _) in enumerate(stage_bounds(hp)):
        T = micro_tokens_at(hp, start)
        if start < end and T not in seen:
            seen.add(T)
            host, device = trainer.launch_probe(start)
            log(f"launch_probe: stage{i} T={T}: host {host:.1f} ms to queue one micro-batch's forward and backward, "
                f"device {device:.1f} ms to run them")
    trainer.reset()


def checkpoint_saved_line(rank, path, t0):
    """The log's line for a checkpoint just saved at path (save_checkpoint began at perf_counter t0): its size and
    seconds, read on rank 0 alone (None elsewhere). Rank 0 renames the folder once every rank has written its file,
    so another rank may return from save_checkpoint before path exists."""
    if rank != 0:
        return None
    return f"checkpoint_saved: {path} {dir_bytes(path) / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s"


HERE = os.path.dirname(os.path.abspath(__file__))
AHEAD_ENTRY = "import train_gpt; train_gpt.compile_ahead()"  # run in HERE, the spec on stdin
# ahead_graphs' training-step processes need a GPU of at least this many GiB: each holds about what the run holds at
# its peak (the parameters, the optimizer, one micro-step's activations; notes/2026-11-29_CompileAhead1xH200 has the
# figures), and up to two of them run beside the run's first training steps
AHEAD_TRAINING_GIB = 120


def ahead_spec(hp, args, d, train_files, val_files, step, precompiled=None):
    """What compile_ahead needs to make one of this run's graphs: the settings (no HellaSwag: its examples are not
    read there), this rank's device, the shards, --deterministic (torch's deterministic algorithms are part of
    inductor's cache key), the graph: the training step at ``step``, or validation (None), and where
    --compile-cache keeps whole compiled functions (precompiled: Compilation.precompiled)."""
    return {"hp": dataclasses.asdict(dataclasses.replace(hp, hellaswag_every=0)), "device": str(d.device),
            "train_files": [str(f) for f in train_files], "val_files": [str(f) for f in val_files],
            "deterministic": args.deterministic, "step": step,
            "precompiled": None if precompiled is None else str(precompiled)}


# Settings that no compiled graph depends on: left out of graphs_key
NOT_IN_GRAPHS = ("train_files", "val_files", "seed", "val_every", "save_every", "log_train_loss", "hellaswag_file",
                 "hellaswag_limit", "profile_steps", "compile_ahead")


def graphs_key(hp, args, d):
    """What a run's compiled graphs depend on, as a hex digest: its settings but NOT_IN_GRAPHS, --deterministic,
    and CompileCache's stamp for its device (the versions, the GPU, the code). Compilation keys its compiled_mark
    with it. A setting wrongly left in only costs second processes that a warm run did not need."""
    settings = {k: v for k, v in dataclasses.asdict(hp).items() if k not in NOT_IN_GRAPHS}
    what = {"hp": settings, "deterministic": args.deterministic, "stamp": CompileCache.current_stamp(d.device)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def start_compile_ahead(compiling, hp, args, d, train_files, val_files):
    """Start a compile_ahead process for each of ahead_graphs, where the run compiles (Compilation.compiles_ahead)
    and hp.compile_ahead (--no-compile-ahead: none). Where the inductor cache holds this run's graphs already (its
    compiled_mark), the log says so and none starts."""
    if hp.compile_ahead and compiling.marked:
        compiling.log("compile_ahead: none started: a run of these graphs finished its compile warmup with this "
                      "inductor cache")
    if hp.compile_ahead and compiling.compiles_ahead():
        for name, step in ahead_graphs(hp, d.device):
            compiling.start_ahead(name, [sys.executable, "-c", AHEAD_ENTRY],
                                  ahead_spec(hp, args, d, train_files, val_files, step, compiling.precompiled()),
                                  HERE)


def compile_ahead():
    """A second process of a compiling run (train: Compilation.start_ahead for each of ahead_graphs, started before
    the Trainer): with the run's settings from stdin (ahead_spec) it makes a Trainer on the run's device and runs
    one training step at the spec's step (its micro-batch length's graph), or validates one micro-batch, as the
    compile warmup will. The graph goes into the compile caches while the run compiles another, and the run then
    loads it (a cache hit) instead of compiling it. It prints the loss it got (the run's log shows none of its
    output) and ends with the run (end_with_the_parent)."""
    t0 = time.perf_counter()
    spec = json.load(sys.stdin)
    end_with_the_parent()
    set_up_process(types.SimpleNamespace(deterministic=spec["deterministic"]))
    hp = saved_hyperparameters("the run's settings", {"hyperparameters": spec["hp"]}, Hyperparameters, Stage)
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    trainer = Trainer(hp, Dist(device=device), spec["train_files"], spec["val_files"],
                      precompiled=spec.get("precompiled"))
    t1 = time.perf_counter()
    try:
        if spec["step"] is None:
            loss, what = trainer.validate(windows_at(hp, hp.total_steps - 1), max_micro=1), "validation"
        else:
            trainer.loader.rewind(spec["step"])
            loss, what = trainer.train_step(spec["step"], want_loss=True), f"training step {spec['step']}"
    finally:
        trainer.loader.close()
    t2 = time.perf_counter()
    print(f"compile_ahead: {what}: loss {loss!r}", flush=True)
    print(ahead_report(t2 - t0, t1 - t0, t2 - t1, compile_report(compile_metrics(), [])[0]), flush=True)


def train(hp, args, d, startup):
    """One training run: files, --resume check, log, compile warmup, the timed steps with validations, HellaSwag
    and checkpoints (the clock stops during each), the footer. A failure after the log opened ends it with
    run_failed:, Ctrl-C with run_interrupted: (cli.Interrupted). Returns (log path, checkpoint folder)."""
    hp, train_files, val_files, log, ckpt_dir = open_run(hp, args, d)
    startup.lap("shards and log")
    step = None  # the step the timed loop is at (None before it)
    with run_outcome(log, args, ckpt_dir, hp.total_steps, lambda: step):
        if d.rank == 0:
            tidy_checkpoints(args, log)
        key = graphs_key(hp, args, d) if hp.compile else None
        compiling = Compilation(hp.compile, args.compile_cache, d, log, key)
        start_compile_ahead(compiling, hp, args, d, train_files, val_files)
        startup.lap("compile cache")
        trainer = Trainer(hp, d, train_files, val_files, startup.lap, precompiled=compiling.precompiled())
        fns = trainer.fns
        for name, path in (("lm_head_matmul", fns.head_path), ("embedding_backward", fns.embed_path),
                           ("mlp", fns.mlp_path), ("compile_options", fns.compile_path)):
            log(f"{name}: {path}")
        if hp.xsa:
            log(f"xsa: layers {', '.join(map(str, hp.xsa_layers))} (the attention layers without paired heads)")
        log(f"val_tokens_used: {trainer.val_micro * hp.val_micro_tokens} "
            f"({trainer.val_micro} micro-batches of {hp.val_micro_tokens})")
        log(startup.line())
        compiling.warmup(lambda: warmup(trainer, log, compiling.ahead_done), lambda names: ahead_frames(hp, names))
        if hp.profile_steps > 0 and d.device.type == "cuda":
            launch_probes(trainer, log)
        if hp.profile_steps > 0:  # untimed, from the initial weights, then the state reset (profiling.profile_stages)
            profile_stages([b[:2] for b in stage_bounds(hp)], hp.profile_steps, trainer.loader.rewind,
                           lambda s: trainer.train_step(s, want_loss=False), trainer.reset, log, d)
        compiling.timed_run_starts()
        start_step, train_ms = 0, 0.0
        if args.resume:
            ck = load_checkpoint(args.resume, trainer.params, trainer.opt, d)
            trainer.loader.load_state(ck["loader"])
            log(f"resumed_from: {args.resume} step {ck['step']}")
            start_step, train_ms = ck["step"], ck["train_time_ms"]
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        T = hp.total_steps
        clock = StepClock(d.device, train_ms)  # the train time; a step's line once the device finished it

        def log_steps():
            for s, ms, loss in clock.finished():
                tail = f" train_loss:{loss:.6f}" if loss is not None else ""
                log(f"step:{s + 1}/{T} train_time:{ms:.0f}ms step_avg:{ms / (s + 1):.2f}ms{tail}")

        # The compile leaves many objects behind: collect the garbage before the clock starts (as record #74 does)
        # and freeze the survivors, so that a full collection inside a timed step walks only the objects made since.
        gc.collect()
        gc.freeze()
        step = start_step
        try:
            clock.start()
            for step in range(start_step, T + 1):
                last = step == T
                validate = last or (hp.val_every > 0 and step % hp.val_every == 0)
                hellaswag = trainer.hellaswag is not None and (last or step % hp.hellaswag_every == 0)
                save = last or (hp.save_every > 0 and step % hp.save_every == 0 and step > 0)
                save = save and not (args.resume and step == start_step)  # the checkpoint it resumed from
                if validate or hellaswag or save:  # untimed: the clock stops once the queued steps are done
                    clock.stop()
                    log_steps()
                    if validate:
                        windows, yarn_long = val_windows(hp, step)
                        val = trainer.validate(windows, yarn_long=yarn_long)
                        log(f"step:{step}/{T} val_loss:{val:.4f} train_time:{clock.ms:.0f}ms "
                            f"step_avg:{clock.ms / max(step, 1):.2f}ms")
                    if hellaswag:
                        model = model_logits(hp, trainer.params, trainer.fns, trainer.rot_cache,
                                             windows_at(hp, min(step, T - 1)))
                        res = trainer.hellaswag.evaluate(model)
                        log(f"step:{step}/{T} hellaswag_acc_norm:{res['acc_norm']:.4f}")
                    if save:
                        t0 = time.perf_counter()
                        path = save_checkpoint(ckpt_dir, step, trainer.params, trainer.opt, trainer.loader.state,
                                               clock.ms, d, hp, log.path, args.keep_last)
                        line = checkpoint_saved_line(d.rank, path, t0)
                        if line:
                            log(line)
                    clock.start()
                if last:
                    break
                trainer.train_step(step, hp.log_train_loss, clock=clock)
                log_steps()  # on a GPU the step before this one, seen done while this one's first micro-batch ran
        finally:
            trainer.loader.close()
            gc.unfreeze()  # frozen objects are never collected, and Triton's bindings report theirs as leaked at exit
        stage_ms = {}
        for s, ms in clock.step_ms.items():
            stage_ms.setdefault(stage_at(hp, s)[0], []).append(ms)
        C = hp.model_dim  # the weights in matmuls per token: the banks' matrices and the LM head (for the MFU)
        weights = len(hp.attn_layers) * 4 * C * C + hp.num_layers * 2 * hp.mlp_dim * C + C * hp.vocab_size
        tokens = sum(stage_at(hp, s)[1].batch_tokens for s in range(start_step, T))
        log_summary(log, d, tokens, clock.ms, stage_ms, weights)
        compiling.log_recompiles()
    return log.path, ckpt_dir


# -----------------------------------------------------------------------------
# Evaluation and sampling: the model as evaluation.py takes it (model_logits) and a checkpoint's (load_model)


@torch.no_grad()
def sequence_logits(hp, params, fns, ids, rot_cache, rows=None, windows=None):
    """(len(rows), real_vocab(hp)) fp32 next-token logits at the positions ``rows`` (default: all) of ids (n,)
    int32: one or more documents, each starting with BOS, padded on the right with BOS to a multiple of BLOCK (the
    model is causal). windows: in blocks, default the last stage's. Eager: evaluation runs each length a few times."""
    n = ids.numel()
    T = -(-n // BLOCK) * BLOCK
    x = torch.cat([ids, ids.new_full((T - n,), hp.bos_id)])
    h = fns.layers(*model_inputs(hp, params, fns, MicroBatch(x), windows or hp.stages[-1].windows, rot_cache))
    h = h[:n] if rows is None else h[rows]
    return head_logits(h, params["lm_head"], hp.softcap)[:, :real_vocab(hp)].float()


def model_logits(hp, params, fns, rot_cache, windows=None):
    """The model as evaluation.py takes it: logits(ids, rows) = sequence_logits with the rest bound."""
    return lambda ids, rows=None: sequence_logits(hp, params, fns, ids, rot_cache, rows, windows)


def load_model(path, d):
    """Hyperparameters, parameters (on d.device) and eager model functions of a checkpoint folder."""
    ck = read_checkpoint(path, 0)
    hp = saved_hyperparameters(path, ck, Hyperparameters, Stage)
    params = {k: v.to(d.device) for k, v in ck["params"].items()}
    for k, init in ADDED_PARAMS.items():  # a checkpoint written before the feature: its parameter at init
        if k not in params:
            params[k] = init(hp).to(d.device)
    return hp, params, build_fns(hp, d.device, compile_model=False)


# -----------------------------------------------------------------------------
# Entry point


def main(argv=None):
    """Train, or with --sample / --hellaswag evaluate a checkpoint; returns what that mode returns (training: the
    log's path and the checkpoint folder). cli.py reads and checks the flags before any work, and makes a bad
    setting one line with exit code 2 and Ctrl-C exit code 130."""
    startup = StartupClock(launch_phases())
    args, hp = parse_args(argv, Hyperparameters, smoke_hyperparameters, __doc__.split("\n")[0])
    with one_line_errors():
        check_settings(hp, args, check_world_size, untie_step, BLOCK)
        set_up_process(args)
        d = setup_distributed()
        startup.lap("process group")
        try:
            if args.sample:
                return sample(args, d, load_model, model_logits)
            if args.hellaswag:
                return evaluate_hellaswag(args, d, load_model, model_logits, BLOCK)
            torch.manual_seed(hp.seed)
            return train(hp, args, d, startup)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
