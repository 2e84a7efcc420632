"""Tokenize local text with GPT-2's BPE into shards the trainer reads (format: data/shards.py).

    python data/prepare_text.py notes/ code/ --out data/mytext --name fineweb
    python data/prepare_text.py corpus.jsonl --out data/mytext --text-field content --shard-tokens 10_000_000

Documents: every text file is one document (any extension; folders are walked recursively in sorted order,
skipping hidden names like ``.git``); every line of a ``.jsonl`` file is one document (its ``text`` field,
``--text-field`` to change). Unreadable files, binary files (a NUL byte in the first 8 KiB) and files that are
not UTF-8 are skipped and counted; a malformed ``.jsonl`` line is an error naming ``file:line``.

Token stream: ``<|endoftext|>`` (50256), then ``encode_ordinary(text)``, for each document in input order.
Special-token strings inside a document are encoded as ordinary text.

Split: a document goes to val when ``sha256(identity)`` (first 8 bytes as an integer / 2^64) is below
``--val-fraction``, else to train. The identity is the path relative to the folder given on the command line
(or the file name, for a file given directly), plus ``:LINE`` for a ``.jsonl`` record. So the split depends
only on the document, never on input order, other documents, or randomness.

Output: ``DIR/NAME_val_000000.bin`` (``_000001`` ... if val is larger than a shard) and
``DIR/NAME_train_000001.bin``, ``..._000002.bin`` ..., each at most ``--shard-tokens`` tokens. A document that
does not fit in the current shard starts the next one; only a document longer than a whole shard is split.
NAME defaults to ``fineweb`` so the trainer's default globs (``fineweb_train_*.bin``) read the output with
just a different folder. Existing shards of NAME in DIR are refused unless ``--force`` (which deletes them
first); on any error the shards written by this run are removed, and so are the folders it created.
"""
import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a script: make `data.shards` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.shards import MAX_TOKEN, ShardError, write_shard  # noqa: E402

DEFAULT_NAME = "fineweb"
DEFAULT_SHARD_TOKENS = 100_000_000  # same size as the FineWeb10B shards (200 MB each)
# FineWeb10B keeps ~1% of its tokens for val (100M of ~10B).
DEFAULT_VAL_FRACTION = 0.01
SNIFF_BYTES = 8192  # a NUL byte in this prefix marks a file as binary (text files never contain NUL)
# Text handed to the tokenizer threads per batch: large enough to keep every thread busy, small enough to
# keep the memory of one batch (text + token lists) to a few hundred MB.
BATCH_CHARS = 32 * 2**20
BATCH_DOCS = 8192
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PrepareError(Exception):
    """A problem with the inputs, options or tokenizer files; main() prints it as one line and exits with code 2."""


# tiktoken's cache names of GPT-2's BPE files (the sha1 of their URLs), which it looks for in TIKTOKEN_CACHE_DIR
GPT2_CACHE_NAMES = {"vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
                    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}


# ----------------------------------------------------------------------------------------------------------
# Tokenizer

def load_gpt2():
    """tiktoken's gpt2 encoding, or a PrepareError saying how to make it available offline."""
    try:
        import tiktoken
    except ImportError:
        raise PrepareError("tiktoken is not installed: pip install tiktoken") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as exc:  # tiktoken fetches the files it lacks over HTTP; any failure there lands here
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        names = " and ".join(f"{f} as {n}" for f, n in GPT2_CACHE_NAMES.items())
        if cache and all((Path(cache) / n).is_file() for n in GPT2_CACHE_NAMES.values()):
            reason = (str(exc).strip().splitlines() or [""])[0][:200]  # the files are there: something else failed
            raise PrepareError(f"cannot load tiktoken's gpt2 files from TIKTOKEN_CACHE_DIR={cache} "
                               f"({type(exc).__name__}: {reason})") from None
        where = f"TIKTOKEN_CACHE_DIR={cache} lacks them" if cache else "TIKTOKEN_CACHE_DIR is not set"
        raise PrepareError(
            f"tiktoken's GPT-2 tokenizer files are missing and cannot be downloaded ({type(exc).__name__}; {where}): "
            f"put {names} into a folder and set TIKTOKEN_CACHE_DIR to it (see data/README.md)") from None


def _check_encoding(encoding):
    """Return the encoding's end-of-text id; refuse encodings whose ids do not fit uint16 shards."""
    try:
        eot = encoding.eot_token
    except KeyError:
        raise PrepareError(f"encoding {encoding.name!r} has no <|endoftext|> token") from None
    if encoding.max_token_value > MAX_TOKEN:
        raise PrepareError(f"encoding {encoding.name!r} has token ids up to {encoding.max_token_value}, "
                           f"more than the uint16 shard format holds ({MAX_TOKEN})")
    return eot


# ----------------------------------------------------------------------------------------------------------
# Inputs

def split_of(identity, val_fraction):
    """'val' or 'train' for a document identity: a hash, so it depends on nothing else."""
    digest = hashlib.sha256(identity.encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def find_files(inputs):
    """[(path, identity)] for the inputs: files as given, folders walked recursively in sorted order."""
    found = []
    for inp in inputs:
        root = Path(inp)
        if root.is_file():
            found.append((root, root.name))
        elif root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                # Sorting in place makes os.walk descend in sorted order; hidden entries (.git, .venv) are
                # tool state, not text.
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for fname in sorted(f for f in filenames if not f.startswith(".")):
                    path = Path(dirpath) / fname
                    found.append((path, path.relative_to(root).as_posix()))
        else:
            raise PrepareError(f"input {inp} does not exist")
    return found


def _size(path):
    """File size in bytes, 0 for what cannot be stat'ed (broken links); only used for the progress bar."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def iter_documents(files, text_field, stats, progress):
    """Yield (identity, text, n_bytes) per document, counting skipped files and empty documents in stats.

    Bytes of skipped input advance ``progress`` here; the caller advances it by ``n_bytes`` once the
    document is tokenized, so the bar tracks tokenization rather than reading.
    """
    for path, identity in files:
        if path.suffix == ".jsonl":
            yield from _iter_jsonl(path, identity, text_field, stats, progress)
            continue
        try:
            data = path.read_bytes()
        except OSError:
            stats["unreadable"] += 1
            progress.update(_size(path))
            continue
        if b"\0" in data[:SNIFF_BYTES]:
            stats["binary"] += 1
            progress.update(len(data))
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            stats["binary"] += 1
            progress.update(len(data))
            continue
        if text:
            yield identity, text, len(data)
        else:
            stats["empty"] += 1


def _iter_jsonl(path, identity, text_field, stats, progress):
    try:
        f = open(path, "rb")
    except OSError:
        stats["unreadable"] += 1
        progress.update(_size(path))
        return
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                progress.update(len(raw))
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise PrepareError(f"{where}: line is not valid UTF-8 ({exc.reason})") from None
            except json.JSONDecodeError as exc:
                raise PrepareError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise PrepareError(f"{where}: record has no string field {text_field!r} "
                                   f"(use --text-field to name the field holding the text)")
            if record[text_field]:
                yield f"{identity}:{lineno}", record[text_field], len(raw)
            else:
                stats["empty"] += 1
                progress.update(len(raw))


# ----------------------------------------------------------------------------------------------------------
# Output

def shard_path(out_dir, name, split, index):
    return Path(out_dir) / f"{name}_{split}_{index:06d}.bin"


class ShardWriter:
    """Packs documents of one split into shards of at most `capacity` tokens.

    A document that does not fit in the room left starts a new shard (cutting at document boundaries);
    only a document longer than a whole shard is cut, filling the current shard first.
    """

    def __init__(self, out_dir, name, split, first_index, capacity):
        self.out_dir, self.name, self.split = Path(out_dir), name, split
        self.index, self.capacity = first_index, capacity
        self.buf = np.empty(capacity, dtype=np.uint16)  # one shard; pages are touched only as it fills
        self.fill = 0
        self.paths = []  # shards written so far
        self.n_tokens = 0
        self.n_docs = 0

    def add(self, doc):
        """Append one document (uint16 array, EOT first)."""
        n = doc.size
        if self.fill + n > self.capacity and n <= self.capacity:
            self.flush()
        pos = 0
        while pos < n:
            take = min(self.capacity - self.fill, n - pos)
            self.buf[self.fill:self.fill + take] = doc[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.capacity:
                self.flush()
        self.n_tokens += n
        self.n_docs += 1

    def flush(self):
        if self.fill == 0:
            return
        path = shard_path(self.out_dir, self.name, self.split, self.index)
        write_shard(path, self.buf[:self.fill])
        self.paths.append(path)
        self.index += 1
        self.fill = 0


def existing_shards(out_dir, name):
    out_dir = Path(out_dir)
    return sorted(list(out_dir.glob(f"{name}_val_*.bin")) + list(out_dir.glob(f"{name}_train_*.bin")))


# ----------------------------------------------------------------------------------------------------------
# Driver

def prepare(inputs, out_dir, encoding, name=DEFAULT_NAME, val_fraction=DEFAULT_VAL_FRACTION,
            shard_tokens=DEFAULT_SHARD_TOKENS, workers=1, text_field="text", force=False):
    """Tokenize ``inputs`` into shards in ``out_dir``; return {"val": writer, "train": writer, "stats": {...}}."""
    from tqdm import tqdm

    eot = _check_encoding(encoding)
    files = find_files(inputs)
    out_dir = Path(out_dir)
    old = existing_shards(out_dir, name) if out_dir.is_dir() else []
    if old and not force:
        raise PrepareError(f"{out_dir} already holds {len(old)} shard(s) named {name}_*.bin (e.g. {old[0].name}); "
                           f"pass --force to replace them, or choose another --name or --out")
    for path in old:
        path.unlink()
    made = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # removed again if this run fails
    out_dir.mkdir(parents=True, exist_ok=True)

    writers = {"val": ShardWriter(out_dir, name, "val", 0, shard_tokens),
               "train": ShardWriter(out_dir, name, "train", 1, shard_tokens)}
    stats = {"files": len(files), "unreadable": 0, "binary": 0, "empty": 0}

    def tokenize(batch, progress):
        token_lists = encoding.encode_ordinary_batch([text for _, text, _ in batch], num_threads=workers)
        for (identity, _, n_bytes), tokens in zip(batch, token_lists):
            doc = np.empty(len(tokens) + 1, dtype=np.uint16)  # ids <= max_token_value <= 65535, checked
            doc[0] = eot
            doc[1:] = tokens
            writers[split_of(identity, val_fraction)].add(doc)
            progress.update(n_bytes)

    total_bytes = sum(_size(path) for path, _ in files)
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr) as progress:
            batch, batch_chars = [], 0
            for item in iter_documents(files, text_field, stats, progress):
                batch.append(item)
                batch_chars += len(item[1])
                if batch_chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                    tokenize(batch, progress)
                    batch, batch_chars = [], 0
            tokenize(batch, progress)
        for writer in writers.values():
            writer.flush()
        _check_splits(inputs, writers, stats, val_fraction)
    except BaseException:
        for writer in writers.values():
            for path in writer.paths:
                path.unlink(missing_ok=True)
        for folder in made:  # innermost first; a folder something else wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return {"val": writers["val"], "train": writers["train"], "stats": stats}


def _check_splits(inputs, writers, stats, val_fraction):
    n_docs = writers["val"].n_docs + writers["train"].n_docs
    if n_docs == 0:
        raise PrepareError(f"no documents found in {' '.join(map(str, inputs))}: {stats['files']} files seen, "
                           f"{stats['unreadable']} unreadable, {stats['binary']} binary or not UTF-8, "
                           f"{stats['empty']} empty documents")
    if val_fraction > 0 and writers["val"].n_docs == 0:
        raise PrepareError(f"no document fell into the val split ({n_docs} documents, --val-fraction "
                           f"{val_fraction}); raise --val-fraction or add documents")
    if writers["train"].n_docs == 0:
        raise PrepareError(f"no document fell into the train split ({n_docs} documents, --val-fraction "
                           f"{val_fraction}); lower --val-fraction or add documents")


def format_summary(result, out_dir, name):
    lines = []
    for split in ("val", "train"):
        w = result[split]
        lines.append(f"{split:<5} {w.n_tokens:>15,} tokens {w.n_docs:>12,} documents {len(w.paths):>5} shards "
                     f"({Path(out_dir) / f'{name}_{split}_*.bin'})")
    s = result["stats"]
    lines.append(f"skipped {s['unreadable']} unreadable files, {s['binary']} binary or non-UTF-8 files, "
                 f"{s['empty']} empty documents (of {s['files']} files)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command line

def _ranged(kind, lo, hi, what):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not lo(value) or not hi(value):
            raise argparse.ArgumentTypeError(f"{what} out of range: {text}")
        return value
    return parse


def _name(text):
    if not _NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"NAME must be letters, digits, '.', '_' or '-' (got {text!r})")
    return text


def build_parser():
    parser = argparse.ArgumentParser(
        prog="prepare_text.py",
        description="Tokenize local text files / .jsonl records with GPT-2's BPE (tiktoken 'gpt2') into "
                    "token shards: DIR/NAME_val_000000.bin and DIR/NAME_train_000001.bin, ...",
        epilog="Each document is '<|endoftext|>' + its tokens. A document's split is a hash of its identity "
               "(path relative to the input folder, plus ':LINE' for .jsonl records). Folders are walked "
               "recursively in sorted order, skipping hidden names; binary and non-UTF-8 files are skipped "
               "and counted. Offline: set TIKTOKEN_CACHE_DIR to a folder with tiktoken's gpt2 files.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, .jsonl files or folders")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder (created)")
    parser.add_argument("--name", type=_name, default=DEFAULT_NAME,
                        help=f"shard name prefix (default {DEFAULT_NAME!r}, which the trainer's default "
                             f"--train-files/--val-files globs expect)")
    parser.add_argument("--val-fraction", type=_ranged(float, lambda v: v >= 0, lambda v: v < 1, "F"),
                        default=DEFAULT_VAL_FRACTION, metavar="F",
                        help=f"expected fraction of documents in val, 0 <= F < 1 (default {DEFAULT_VAL_FRACTION}; "
                             f"0 writes no val shard)")
    parser.add_argument("--shard-tokens", type=_ranged(int, lambda v: v >= 1,
                                                       lambda v: v < 2**31, "N"),
                        default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help=f"max tokens per shard (default {DEFAULT_SHARD_TOKENS:_})")
    parser.add_argument("--workers", type=_ranged(int, lambda v: v >= 1, lambda v: True, "K"),
                        default=min(8, os.cpu_count() or 1), metavar="K",
                        help="tokenizer threads (default min(8, CPU count))")
    parser.add_argument("--text-field", default="text", help="field of a .jsonl record holding the text")
    parser.add_argument("--force", action="store_true",
                        help="delete existing NAME_*.bin shards in DIR instead of refusing")
    return parser


def main(argv=None, encoding=None):
    """Command-line entry point; ``encoding`` replaces tiktoken's gpt2 (tests pass a tiny offline one)."""
    args = build_parser().parse_args(argv)
    try:
        enc = encoding if encoding is not None else load_gpt2()
        result = prepare(args.inputs, args.out, enc, name=args.name, val_fraction=args.val_fraction,
                         shard_tokens=args.shard_tokens, workers=args.workers, text_field=args.text_field,
                         force=args.force)
    except (PrepareError, ShardError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # reading an input or writing a shard failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; the shards of this run were removed", file=sys.stderr)
        return 130
    print(format_summary(result, args.out, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
