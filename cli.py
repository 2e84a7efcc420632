"""train_gpt.py's command line: its flags, the settings' checks, the process settings, one-line errors and Ctrl-C.

``parse_args`` makes one flag per field of train_gpt.py's Hyperparameters (flags.py) next to the run's own flags
(--run-id, --resume, --sample, ...), and returns the hyperparameters they give. ``check_settings`` checks every
setting that needs no file before any work starts; ``smoke_corpus`` and ``fit_to_data`` fit them to the shards.
``open_run`` starts a training run (shards, --resume check, log) and ``run_outcome`` ends its log when it fails or
is interrupted. ``one_line_errors`` wraps train_gpt.py's main(): a problem with the user's settings, data,
checkpoint or launch is one line `train_gpt.py: error: ...` on stderr, printed by rank 0 only under torchrun, and
SystemExit(2) on every rank (bugs keep their traceback); Ctrl-C is one line `train_gpt.py: interrupted ...` (in
training: where to resume from, ``interrupted_message``) and SystemExit(130). This module imports nothing from
train_gpt.py: what it needs of it (the dataclass, the smoke config, the checks that read the schedule) is passed in.
"""
import contextlib
import dataclasses
import glob
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from checkpoints import RESUME_MAY_DIFFER, CheckpointError, check_resume, check_resume_flags, last_checkpoint
from data.hellaswag import HellaSwagError
from data.prepare_text import PrepareError, load_gpt2
from data.shards import ShardError, check_token_ids, load_shard
from data.smoke_corpus import OUT_DIR, write_smoke_corpus
from evaluation import GPT2_VOCAB
from flags import (FLAG_ALIASES, ArgumentParser, SettingsError, add_dataclass_flags, check_ranges, flag_name,
                   launch_rank)
from kernels.hardware import keep_freed_memory
from run_log import check_run_id, new_run_id, open_log, resolve_files

NOT_FLAGS = ("stages",)  # a table of Stage rows: edited in the code, not on the command line
SMOKE_CORPUS = OUT_DIR  # where --smoke without shards writes its corpus (data/smoke_corpus.py)


def parse_args(argv, hyperparameters, smoke_hyperparameters, description=None):
    """(args, hp): the command line (sys.argv[1:] when argv is None) and the hyperparameters it gives: the
    dataclass ``hyperparameters`` (or with --smoke ``smoke_hyperparameters()``) with the flags given set; compile
    off without CUDA (the CPU runs eagerly). Values are checked by check_settings."""
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(
        prog="train_gpt.py", description=description,
        usage="%(prog)s [--smoke] [--FIELD-NAME VALUE ...] [--sample CKPT] (--help lists all)",
        epilog="The Stage table (batch size, windows, lr per stage) is edited in the code. Step lines: train_loss "
               "(--train-loss) is the training objective, with --mtp the weighted sum of the losses on the next "
               "1, 2, 3 tokens (weights 1, .5, .25 at the start), so about 1.75 x ln(vocab_size) = 18.9 at step 1 "
               "for GPT-2's vocabulary; val_loss is the next-token loss alone (ln(50304) = 10.8 untrained). "
               "Every setting is checked before any work: a bad one is one line naming the flag, exit code 2.")
    smoke = "--smoke" in argv
    defaults = smoke_hyperparameters() if smoke else hyperparameters()
    config = "the smoke config (--smoke)" if smoke else "the speedrun; --smoke --help shows the smoke config's"
    from_data = ("vocab_size", "bos_id") if defaults.vocab_from_data else ()
    add_dataclass_flags(p.add_argument_group(f"hyperparameters (defaults: {config})"), hyperparameters, defaults,
                        FLAG_ALIASES, NOT_FLAGS,
                        shown=lambda name, v: "from the shards (--vocab-from-data)" if name in from_data else repr(v))
    p.add_argument("--run-id", help="name of the run: its log is LOG_DIR/RUN_ID.txt, its checkpoints "
                                    "CHECKPOINT_DIR/RUN_ID/step_NNNNNN; an id whose log or checkpoint folder "
                                    "exists is refused (default: date_time_random, new for each run)")
    p.add_argument("--checkpoint-dir", default="checkpoints", metavar="CHECKPOINT_DIR",
                   help="folder of the runs' checkpoint folders (default: %(default)s)")
    p.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="after each save, delete all but the newest N checkpoints of this run, 0 to keep all (default: "
                        "%(default)s). A checkpoint, CHECKPOINT_DIR/RUN_ID/step_NNNNNN, holds one file per rank: that "
                        "rank's shard of the optimizer state (fp32 master weights; Adam's two moments or Muon's "
                        "momentum and second moments; between two slow Adam steps, their summed gradients), the "
                        "loader's position, the RNG state, the train time, the hyperparameters and the run's id and "
                        "log; rank 0's also holds every parameter (bf16 matrices): 10 to 14 bytes per parameter")
    p.add_argument("--log-dir", default="logs", metavar="LOG_DIR",
                   help="folder of the runs' logs (default: %(default)s)")
    free = ", ".join(map(flag_name, RESUME_MAY_DIFFER))
    p.add_argument("--resume", help="checkpoint folder (.../step_NNNNNN) to continue from: the world size and "
                                    "every hyperparameter, the schedule and --seed included, must equal the "
                                    f"checkpoint's (refused otherwise), except {free}")
    p.add_argument("--deterministic", action="store_true", help="bitwise-reproducible loss lines")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU-sized run (eager; on a GPU --smoke --compile compiles it)")
    p.add_argument("--hellaswag", metavar="CHECKPOINT",
                   help="checkpoint folder: print its HellaSwag accuracy and write it to a new hellaswag_N.json "
                        "there (N = 1, 2, ...: an earlier result is never overwritten)")
    p.add_argument("--sample", metavar="CHECKPOINT", help="checkpoint folder: print text generated from it")
    p.add_argument("--prompt", default="The", help="--sample: the text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="--sample: tokens generated per sample, >= 1 (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="--sample: sampling temperature, 0 for greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="--sample: sample among the K most likely tokens, 0 for all (default: %(default)s)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="--sample: continuations to print, drawn one after another from one generator seeded by "
                        "--seed (default: %(default)s)")
    p.add_argument("--compile-cache", metavar="PATH",
                   help="directory of compile artifacts: loaded at start when its torch/Triton/GPU/code stamp "
                        "matches (else emptied and compiled cold), saved after the compile warmup; the training "
                        "and validation steps are kept there as whole functions compiled ahead of time, which a "
                        "later run loads without tracing them (torch's aot_compile)")
    args = p.parse_args(argv)
    hp = smoke_hyperparameters() if args.smoke else hyperparameters()
    hp = dataclasses.replace(hp, **{k: getattr(args, k) for k in given_hyperparameters(args, hyperparameters)})
    if not torch.cuda.is_available():
        hp = dataclasses.replace(hp, compile=False)  # the CPU path runs eagerly (see build_fns)
    return args, hp


def given_hyperparameters(args, hyperparameters):
    """The hyperparameters whose flags the command line gives (field names, in the dataclass's order)."""
    return [f.name for f in dataclasses.fields(hyperparameters) if getattr(args, f.name, None) is not None]


# Bounds (inclusive; None: open) of the hyperparameters checked on their own; the rest are checked together.
HP_RANGES = {
    "scheduled_steps": (1, None), "extension_steps": (0, None), "val_tokens": (1, None), "final_long_window": (1, None),
    "num_layers": (1, None), "model_dim": (1, None), "num_heads": (1, None), "head_dim": (4, None),
    "mlp_dim": (1, None), "gate_dims": (1, None), "vocab_size": (1, None), "bigram_vocab_size": (2, None),
    "cooldown_frac": (0, 1), "cooldown_floor": (0, None), "untie_stage": (0, None), "muon_lr": (0, None),
    "muon_momentum_min": (0, 1), "muon_momentum_max": (0, 1), "muon_warmup_steps": (0, None),
    "muon_cooldown_steps": (0, None), "muon_beta2": (0, 1), "muon_wd": (0, None), "mlp_proj_lr_mul": (0, None),
    "adam_lr": (0, None), "adam_wd": (0, None), "adam_every": (1, None), "profile_steps": (0, None),
    "val_every": (0, None), "save_every": (0, None), "hellaswag_every": (0, None), "hellaswag_limit": (0, None),
    "seed": (0, 2**64 - 1),  # what torch.Generator.manual_seed takes without wrapping around
}
# The same for the flags that are not hyperparameters (sampling, --keep-last).
ARG_RANGES = {"max_new_tokens": (1, None), "temperature": (0, None), "top_k": (0, None), "num_samples": (1, None),
              "keep_last": (0, None)}


def check_mudd(hp):
    """--mudd's layout: record #81's on one stream, gating the last layer from the one before it. A refusal names
    --no-mudd too: MUDD is on by default, so a layout change may be what the user meant."""
    problem = mudd_problem(hp)
    if problem:
        raise SettingsError(f"--mudd: {problem} (or --no-mudd)")


def mudd_problem(hp):
    """What in hp's layout --mudd cannot take, or None."""
    last = hp.num_layers - 1
    if not hp.one_stream:
        return "built on record #77's single stream; add --one-stream"
    if not hp.backout:
        return "its final mix does the backout (it starts at -0.5 x the backout layer's output); leave out --no-backout"
    if hp.num_layers < 3 or max(hp.backout_layer, hp.skip_from) >= last - 1:
        return (f"mixes the outputs of --backout-layer and --skip-from into the last two layers, so both must come "
                f"before layer {last - 1}")
    if last in hp.no_attn_layers or hp.ve_tables[last] < 0 or last in hp.paired_layers:
        return (f"gates the last layer's ({last}) value embedding: it needs attention, a value embedding (--ve-tables) "
                f"and no paired heads")
    if hp.num_heads % 2:
        return f"its value gate has one channel per half of the heads; --num-heads must be even, got {hp.num_heads}"
    return None


def check_settings(hp, args, check_world_size, untie_step, block):
    """Raise SettingsError (or CheckpointError), one line naming the flag, for the first setting that cannot work:
    with --resume the flags given against the checkpoint's (check_resume_flags), the world size (WORLD_SIZE, by
    ``check_world_size``), every hyperparameter's range, the untie stage (``untie_step(hp)`` None: no Adam step to
    untie after), the layer indices and shapes against each other, the sampling flags, and for training the device
    (the full model needs CUDA: without it, --smoke), the run id, which must be new: neither LOG_DIR/RUN_ID.txt
    nor CHECKPOINT_DIR/RUN_ID may exist, and with --prefix-loss tiktoken's gpt2 files (PrepareError). Opens no file
    but the --resume checkpoint and those, allocates nothing. hp: the
    training run's hyperparameters (with --sample / --hellaswag, which take the checkpoint's, only the flags are
    checked). block: the window unit, which the validation micro-batches must be a multiple of."""
    training = not (args.sample or args.hellaswag)
    if args.resume and training:
        check_resume_flags(hp, args.resume, given_hyperparameters(args, type(hp)))
    check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    if args.sample and args.hellaswag:
        raise SettingsError("--sample and --hellaswag: give one of them")
    check_ranges(hp, HP_RANGES)
    check_ranges(args, ARG_RANGES)
    if hp.untie_stage >= len(hp.stages) or untie_step(hp) is None:
        raise SettingsError(f"--untie-stage: {hp.untie_stage} is not a stage with an Adam step to untie after (the "
                            f"stage table has {len(hp.stages)} stages)")
    L = hp.num_layers

    def layer(name, i):
        if not 0 <= i < L:
            raise SettingsError(f"{flag_name(name)}: {i} is not a layer index (--num-layers {L}: 0 .. {L - 1})")

    for name in ("no_attn_layers", "long_window_layers") + (("paired_head_layers",) if hp.paired_heads else ()):
        for i in getattr(hp, name):
            layer(name, i)
    for name in ("skip_from", "skip_to") + (("backout_layer",) if hp.backout else ()):
        layer(name, getattr(hp, name))
    if hp.skip_from >= hp.skip_to:
        raise SettingsError(f"--skip-from {hp.skip_from} must come before --skip-to {hp.skip_to} (the skip is saved "
                            f"at one layer and added at a later one)")
    if not 0 <= hp.parallel_start <= L:
        raise SettingsError(f"--parallel-start: must be a layer index or {L} (one lane), got {hp.parallel_start}")
    if not hp.attn_layers:
        raise SettingsError("--no-attn-layers: lists every layer; at least one layer needs attention")
    if len(hp.ve_tables) != L:
        raise SettingsError(f"--ve-tables: {len(hp.ve_tables)} entries for {L} layers (--num-layers): give one table "
                            f"id per layer, -1 for none")
    for i, t in enumerate(hp.ve_tables):
        if t < -1:
            raise SettingsError(f"--ve-tables: layer {i} has table {t}; table ids are 0, 1, ... (-1: none)")
        if t >= 0 and i in hp.no_attn_layers:
            raise SettingsError(f"--ve-tables: layer {i} has table {t} but no attention (--no-attn-layers); value "
                                f"embeddings are mixed into the attention values")
    unused = sorted(set(range(hp.num_ve)) - set(hp.ve_tables))
    if unused:
        raise SettingsError(f"--ve-tables: table {unused[0]} is used by no layer; number the tables 0, 1, ... "
                            f"without gaps")
    if hp.num_heads * hp.head_dim != hp.model_dim:
        raise SettingsError(f"--num-heads {hp.num_heads} x --head-dim {hp.head_dim} must equal --model-dim "
                            f"{hp.model_dim}")
    if hp.head_dim % 4:
        raise SettingsError(f"--head-dim: must be a multiple of 4 (rotary turns pairs in half the dims), got "
                            f"{hp.head_dim}")
    if hp.paired_heads and hp.paired_head_layers and hp.num_heads % 2:
        raise SettingsError(f"--num-heads: paired heads need an even number, got {hp.num_heads} (or "
                            f"--no-paired-heads)")
    if hp.xsa and not hp.xsa_layers:
        raise SettingsError("--xsa: every attention layer has paired heads (--paired-head-layers), where XSA does not "
                            "apply; take a layer out of --paired-head-layers (or --no-xsa)")
    if hp.mudd:
        check_mudd(hp)
    if hp.muon_qk_pairs and hp.num_heads % 2:
        raise SettingsError(f"--muon-qk-pairs: splits W_q and W_k into pairs of heads; --num-heads must be even, got "
                            f"{hp.num_heads} (or --no-muon-qk-pairs)")
    if hp.mlp_act_only and not hp.fused_mlp:
        raise SettingsError("--mlp-act-only: a mode of the fused MLP kernel, which --no-fused-mlp turns off; leave out "
                            "one of them")
    if hp.gate_dims > hp.model_dim:
        raise SettingsError(f"--gate-dims: the gates read {hp.gate_dims} dims of the residual, more than --model-dim "
                            f"{hp.model_dim}")
    if hp.muon_momentum_min > hp.muon_momentum_max:
        raise SettingsError(f"--muon-momentum-min {hp.muon_momentum_min} is above --muon-momentum-max "
                            f"{hp.muon_momentum_max}")
    if hp.param_dtype not in ("bfloat16", "float32"):  # what the kernels and their tests cover
        raise SettingsError(f"--param-dtype: {hp.param_dtype!r} is not one of bfloat16, float32")
    if hp.val_micro_tokens < block or hp.val_micro_tokens % block:
        raise SettingsError(f"--val-micro-tokens: must be a multiple of {block} (the window unit), got "
                            f"{hp.val_micro_tokens}")
    ids = GPT2_VOCAB if hp.vocab_from_data else hp.vocab_size
    if not 0 <= hp.bos_id < ids:
        raise SettingsError(f"--bos-id: {hp.bos_id} is not a token id (0 .. {ids - 1})")
    if not training:
        return
    if not torch.cuda.is_available() and not args.smoke:
        raise SettingsError("the full model needs a CUDA GPU and torch sees none; use --smoke for a tiny CPU model "
                            "(its flags can be changed like any other)")
    if args.run_id is not None:
        check_run_id(args.run_id, args.log_dir, args.checkpoint_dir)
    if hp.prefix_loss:
        load_gpt2()  # its prefix-token table is GPT-2's (train_gpt.prefix_token_table)


def set_up_process(args):
    """What must be set before CUDA starts: the allocator (expandable segments: the stages' batch shapes share one
    allocator without fragmenting it), and with --deterministic cuBLAS's workspace and torch's deterministic
    algorithms (warn_only: ops without a deterministic kernel warn; our Triton kernels are deterministic and
    FlashAttention's backward is made so per call, kernels/attention.py's doc_attention_bwd). On the CPU:
    keep_freed_memory."""
    if not torch.cuda.is_available():
        keep_freed_memory()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def smoke_corpus(hp, args, d):
    """--smoke with the default --train-files and --val-files both matching no file: hp reading the byte-level
    corpus of this repository's *.py and *.md files (data/smoke_corpus.py), written to SMOKE_CORPUS unless it is
    there, said in one line. Otherwise hp as it is: globs given on the command line are used as given."""
    given = args.train_files is not None or args.val_files is not None
    if not args.smoke or given or glob.glob(hp.train_files) or glob.glob(hp.val_files):
        return hp
    train_files, val_files, made = write_smoke_corpus(SMOKE_CORPUS)
    if d.rank == 0:
        print(f"no shards match {hp.train_files}: --smoke trains on this repository's *.py and *.md files as bytes "
              f"(vocabulary 384, BOS 256), {'written to' if made else 'read from'} {SMOKE_CORPUS}/", flush=True)
    return dataclasses.replace(hp, train_files=train_files, val_files=val_files)


def fit_to_data(hp, train_files, val_files, bos_id=None):
    """Check every shard's ids against the vocabulary, or (vocab_from_data) take the vocabulary from them: ids
    must lie in GPT-2's vocabulary (the tokenizer of --sample and --hellaswag), vocab_size is the largest id + 1
    rounded up to 128, and the document separator is bos_id when stated (--bos-id), else read from the data's
    document structure: a shard is written from a document's start, so the first token of the first training
    shard is the separator, and the first validation shard must start with the same id. (The largest id is no
    separator: one stray id above the BOS would take its place.)"""
    files = list(train_files) + list(val_files)
    if not hp.vocab_from_data:
        check_token_ids(files, hp.vocab_size)
        return hp
    top = check_token_ids(files, GPT2_VOCAB, f"GPT-2's vocabulary of {GPT2_VOCAB} ids (--vocab-from-data)")
    if bos_id is None:
        bos_id = int(load_shard(train_files[0], mmap=True)[0])
        first_val = int(load_shard(val_files[0], mmap=True)[0])
        if first_val != bos_id:
            raise ShardError(f"{val_files[0]}: starts with token id {first_val}, but {train_files[0]} starts with "
                             f"{bos_id}: the first token of a shard begins a document and should be the separator "
                             f"(BOS) in both; state it with --bos-id")
    return dataclasses.replace(hp, vocab_size=-(-(max(top, bos_id) + 1) // 128) * 128, bos_id=bos_id)


def open_run(hp, args, d):
    """A training run's start: --smoke's corpus, the shards (fit_to_data), the --resume check, the run id and the
    log (run_log.open_log). Returns (hp fitted to the shards, train shards, val shards, log, checkpoint folder)."""
    hp = smoke_corpus(hp, args, d)
    train_files, val_files = resolve_files(hp)
    hp = fit_to_data(hp, train_files, val_files, bos_id=args.bos_id)
    continues = check_resume(hp, args.resume, d) if args.resume else None
    run_id = args.run_id or new_run_id(d)
    log = open_log(hp, args, d, train_files, val_files, run_id, continues)
    return hp, train_files, val_files, log, Path(args.checkpoint_dir) / run_id


@contextlib.contextmanager
def run_outcome(log, args, ckpt_dir, total_steps, step):
    """Around a training run once its log is open: Ctrl-C ends the log with run_interrupted: and raises Interrupted,
    saying where the run can resume from (step(): the step the timed loop is at, None before it); any other
    exception ends the log with run_failed: and goes on."""
    try:
        yield
    except KeyboardInterrupt:
        message = interrupted_message(step(), total_steps, last_checkpoint(ckpt_dir, args.resume), args)
        log(f"run_interrupted: {message}", console=False)
        raise Interrupted(message) from None
    except BaseException as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        log(f"run_failed: {type(e).__name__}" + (f": {reason}" if reason else ""), console=False)
        raise


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a training run, with the line saying where it can resume from (message), which
    one_line_errors prints."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


def interrupted_message(step, total_steps, checkpoint, args):
    """The line printed after Ctrl-C in training, and the log's run_interrupted: line: the steps done (step, None
    before the timed loop) and how to resume from the last checkpoint."""
    where = "before the timed steps" if step is None else f"at step {step}/{total_steps}"
    if checkpoint is None:
        return f"interrupted {where}; no checkpoint saved yet (--save-every N saves one every N steps)"
    run_id = " and a new --run-id" if args.run_id else ""
    return (f"interrupted {where}; last checkpoint: {checkpoint} (resume: the same command with --resume "
            f"{checkpoint}{run_id})")


def interrupt_once(signum, frame):
    """The SIGINT handler: a KeyboardInterrupt, then SIGINT ignored while it is handled (under torchrun a Ctrl-C
    reaches each rank twice: from the terminal, then passed on by torchrun)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def one_line_errors():
    """Around train_gpt.py's main(): bad input (settings, data, checkpoint, launch) is one line on stderr and
    SystemExit(2); Ctrl-C is one line and SystemExit(130) (interrupt_once handles SIGINT meanwhile, unless SIGINT
    was ignored from the start: nohup, &)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt_once)
    try:
        yield
    except (FileNotFoundError, ShardError, SettingsError, CheckpointError, HellaSwagError, PrepareError) as e:
        if launch_rank() == 0:
            print(f"train_gpt.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:
        if launch_rank() == 0:
            line = e.message if isinstance(e, Interrupted) else "interrupted"
            print(f"train_gpt.py: {line}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        if signal.getsignal(signal.SIGINT) is interrupt_once:  # after a Ctrl-C it stays ignored: the process ends
            signal.signal(signal.SIGINT, previous)
