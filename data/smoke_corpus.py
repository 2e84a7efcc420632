"""The smoke run's corpus when there are no shards: this repository's own text as bytes (no tokenizer, no network).

``python train_gpt.py --smoke`` with the default --train-files / --val-files matching no file trains on it
(cli.py's ``smoke_corpus``). Documents: the repository's ``*.py`` and ``*.md`` files, sorted by path, one
document per file (hidden folders such as ``.git`` or ``.venv``, installed packages and empty files left out).
Token ids: a file's bytes, 0 .. 255, after BOS = 256, so --smoke's --vocab-from-data takes vocabulary 384 (257
rounded up to a multiple of 128) and BOS 256 from the shards. Split: every VAL_EVERY-th file of that order is held
out for validation. Output, in the shard format of ``data/shards.py``: ``DIR/smoke_train_000001.bin`` and
``DIR/smoke_val_000000.bin``, written once and then reused (delete DIR to make them again from the current files).
"""
import os
from pathlib import Path

import numpy as np

from data.shards import write_shard

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = "data/smoke"  # where --smoke without shards writes the corpus (relative to the working directory)
BOS = 256  # one past the byte values: the document separator
VAL_EVERY = 10  # every 10th file (sorted by path) is a validation document
SUFFIXES = (".py", ".md")
TRAIN_GLOB, VAL_GLOB = "smoke_train_*.bin", "smoke_val_*.bin"


class ByteCodec:
    """The smoke corpus's tokenizer for --sample: a text's UTF-8 bytes as ids 0 .. 255; decoding drops the ids that
    are no byte (BOS and the padding rows of the vocabulary) and replaces invalid UTF-8. The method names are
    tiktoken's, so --sample takes either."""

    @staticmethod
    def encode_ordinary(text):
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids):
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def is_smoke_corpus(train_files, out_dir=OUT_DIR):
    """Whether a run's --train-files glob is the one write_smoke_corpus(out_dir) returns (the byte-level corpus)."""
    return str(train_files) == str(Path(out_dir) / TRAIN_GLOB)


def source_files(repo=REPO):
    """Paths (relative to ``repo``, as posix strings, sorted) of its ``*.py`` and ``*.md`` files, without hidden
    folders, ``site-packages`` (a virtual environment inside the clone) and empty files."""
    repo = Path(repo)
    found = []
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "site-packages"]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in SUFFIXES and not name.startswith(".") and path.stat().st_size > 0:
                found.append(path.relative_to(repo).as_posix())
    return sorted(found)


def documents(repo=REPO):
    """{"train": [...], "val": [...]}: each file's tokens (uint16: BOS, then its bytes), in source_files order."""
    docs = {"train": [], "val": []}
    for i, rel in enumerate(source_files(repo)):
        data = np.frombuffer((Path(repo) / rel).read_bytes(), dtype=np.uint8)
        doc = np.empty(data.size + 1, dtype=np.uint16)
        doc[0], doc[1:] = BOS, data
        docs["val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"].append(doc)
    return docs


def write_smoke_corpus(out_dir, repo=REPO):
    """The corpus's shards in ``out_dir``, written unless both are there already. Returns (train glob, val glob,
    whether they were written now)."""
    out_dir = Path(out_dir)
    train, val = out_dir / "smoke_train_000001.bin", out_dir / "smoke_val_000000.bin"
    made = not (train.is_file() and val.is_file())
    if made:
        docs = documents(repo)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_shard(val, np.concatenate(docs["val"]))  # each write is atomic: a reader sees a whole shard or none
        write_shard(train, np.concatenate(docs["train"]))
    return str(out_dir / TRAIN_GLOB), str(out_dir / VAL_GLOB), made
