"""The token shard format: the one place that knows it (the trainer and the data scripts import this).

Byte layout of a shard (all little-endian)::

    offset  size              content
    0       4                 int32 MAGIC = 20240520
    4       4                 int32 VERSION = 1
    8       4                 int32 n_tokens (>= 1)
    12      1012              int32 zeros (reserved; HEADER_INTS = 256 ints in all)
    1024    2 * n_tokens      uint16 token ids, in reading order

This is the format of the FineWeb10B GPT-2 shards published as ``kjj0/fineweb10B-gpt2`` (and of llm.c /
modded-nanogpt), so those files load unchanged. GPT-2's vocabulary (50257 ids) fits uint16.

Policy choices:
- A shard must hold at least one token: ``write_shard`` refuses an empty array and ``read_header`` rejects
  ``n_tokens == 0``. A loader that cycles through shards would spin forever on an empty one, so an empty
  shard is treated as a bug in whatever wrote it.
- Every problem found in a file raises :class:`ShardError` (a ``ValueError``) whose message names the file
  and says in one sentence what is wrong.
- Writes are atomic: the bytes go to a temporary file in the destination folder, then ``os.replace`` gives it
  the final name, so an interrupted write never leaves a half shard under the final name.

Usage: ``load_shard(path)`` reads the tokens into memory; ``load_shard(path, mmap=True)`` returns a read-only
``np.memmap`` for callers that only slice (the trainer reads every shard so). ``check_token_ids`` checks the ids
of shards against a vocabulary before a run trains on them.
"""
import glob
import os
import uuid
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16, whatever the host's byte order
MAX_TOKEN = 65535

# The magic as a big-endian writer would have stored it; seeing it means the byte order is wrong.
_SWAPPED_MAGIC = int(np.array([MAGIC], dtype="<i4").byteswap()[0])

DOWNLOAD_HINT = "python data/cached_fineweb10B.py 9"


class ShardError(ValueError):
    """A shard file (or the tokens meant for one) is not valid; the message names the file."""


def _check_tokens(path, tokens):
    """Return ``tokens`` as a 1-D little-endian uint16 array, or raise ShardError naming ``path``."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ShardError(f"{path}: tokens must be a 1-D sequence, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise ShardError(f"{path}: refusing to write a shard with no tokens (empty shards are not allowed)")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ShardError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    # uint8/uint16 always fit; anything wider is checked (two reductions, no Python loop).
    if arr.dtype.itemsize > 2 or np.issubdtype(arr.dtype, np.signedinteger):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN:
            bad = lo if lo < 0 else hi
            raise ShardError(f"{path}: token id {bad} is outside [0, {MAX_TOKEN}] and cannot be stored as uint16")
    return arr.astype(TOKEN_DTYPE, copy=False)


def _header(n_tokens):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, n_tokens
    return header


def write_shard(path, tokens):
    """Write ``tokens`` (array-like of ints in [0, 65535], at least one) to ``path`` atomically.

    The data goes to a hidden temporary file in the same folder (same file system, so ``os.replace`` is an
    atomic rename), is flushed and fsynced, then renamed. On any error the temporary file is removed.
    """
    path = Path(path)
    arr = _check_tokens(path, tokens)
    if arr.size > np.iinfo(np.int32).max:
        raise ShardError(f"{path}: {arr.size} tokens do not fit the header's int32 count")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # "xb": never clobber an existing file; the file gets the ordinary umask permissions.
        with open(tmp, "xb") as f:
            f.write(_header(arr.size).tobytes())
            f.write(np.ascontiguousarray(arr).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_header_from(f, path):
    """Validate the header and size of the open binary file ``f``; return n_tokens."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        raise ShardError(f"{path}: file is empty (0 bytes), expected a {HEADER_BYTES}-byte header then tokens")
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    raw = f.read(HEADER_BYTES)
    if len(raw) != HEADER_BYTES:
        raise ShardError(f"{path}: could read only {len(raw)} of the {HEADER_BYTES} header bytes")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, n_tokens = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        if magic == _SWAPPED_MAGIC:
            raise ShardError(f"{path}: magic number is byte-swapped (found {magic}, the big-endian form of "
                             f"{MAGIC}); shards must be written little-endian")
        raise ShardError(f"{path}: bad magic number {magic} (expected {MAGIC}); this is not a token shard")
    if version != VERSION:
        raise ShardError(f"{path}: unsupported format version {version} (this reader supports {VERSION})")
    if n_tokens <= 0:
        raise ShardError(f"{path}: header says {n_tokens} tokens; a shard must hold at least one token")
    expected = HEADER_BYTES + 2 * n_tokens
    if size < expected:
        raise ShardError(f"{path}: file is truncated: header says {n_tokens} tokens ({expected} bytes) "
                         f"but the file has {size} bytes ({expected - size} bytes missing)")
    if size > expected:
        raise ShardError(f"{path}: file has {size - expected} trailing bytes: header says {n_tokens} tokens "
                         f"({expected} bytes) but the file has {size} bytes")
    return n_tokens


def read_header(path):
    """Validate the shard at ``path`` (header fields and exact file size) and return its token count."""
    with open(path, "rb") as f:
        return _read_header_from(f, path)


def load_shard(path, mmap=False):
    """Validated tokens of the shard at ``path`` as a uint16 array of shape (n_tokens,).

    ``mmap=False``: reads the tokens into a freshly allocated array (one read, no extra copy).
    ``mmap=True``: returns a read-only ``np.memmap`` view of the file, for callers that only slice.
    """
    with open(path, "rb") as f:
        n_tokens = _read_header_from(f, path)
        if mmap:
            return np.memmap(f, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))
        tokens = np.empty(n_tokens, dtype=TOKEN_DTYPE)
        got = f.readinto(tokens.view(np.uint8))
    if got != 2 * n_tokens:  # the file shrank after its size was checked
        raise ShardError(f"{path}: read {got} token bytes but the header promised {2 * n_tokens}")
    return tokens


def check_token_ids(files, vocab_size, vocabulary=None):
    """The largest token id in the shards ``files``; a ShardError naming the file and the first position of an id
    >= vocab_size (None: no limit), which would otherwise fail inside the embedding (an IndexError on the CPU, a
    device-side assert on the GPU). vocabulary: what the limit is, for the message (default: the model's
    vocabulary). One vectorised max over each memory-mapped shard (a 100M-token shard is 200 MB: a fraction of a
    second from the page cache)."""
    top = -1
    for f in files:
        tokens = load_shard(f, mmap=True)
        m = int(tokens.max())
        if vocab_size is not None and m >= vocab_size:
            pos = int(np.argmax(tokens >= vocab_size))
            what = vocabulary or f"the model's vocabulary (vocab_size {vocab_size})"
            raise ShardError(f"{f}: token id {int(tokens[pos])} at position {pos} is outside {what}; were these "
                             f"shards made with another tokenizer?")
        top = max(top, m)
    return top


def shard_files(pattern):
    """Sorted list of the files matching the glob ``pattern`` (``**`` allowed); raise if there are none.

    Shard names carry zero-padded indices (``*_000001.bin``), so the sorted order is the index order.
    """
    pattern = os.fspath(pattern)
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        msg = f"no shard files match {pattern!r}"
        if not os.path.isabs(pattern):
            msg += f" (relative to the working directory {os.getcwd()})"
        if "fineweb10B" in Path(pattern).parts:
            msg += f"; download them with `{DOWNLOAD_HINT}` from the repository root"
        raise FileNotFoundError(msg)
    return files
