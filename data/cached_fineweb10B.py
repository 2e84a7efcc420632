"""Download the GPT-2 tokens of FineWeb10B: the val shard and the first N train shards.

    python data/cached_fineweb10B.py 9          # val + 9 train shards (~900M train tokens, ~2 GB)
    python data/cached_fineweb10B.py 9 --dir /scratch/fineweb10B

Source: the Hugging Face dataset repo ``kjj0/fineweb10B-gpt2``: ``fineweb_val_000000.bin`` and
``fineweb_train_000001.bin`` .. ``fineweb_train_000103.bin``, each about 100M tokens (~200 MB) in the format
of ``data/shards.py``. Files go to ``data/fineweb10B/`` next to this script unless ``--dir`` says otherwise,
which is where the trainer's default globs look.

Behaviour: a file already present and valid is skipped; a present but invalid one is reported, deleted and
downloaded again; every download is verified (header and exact size) and a corrupt one is deleted and the
script exits 1 naming it. ``hf_hub_download`` keeps partial downloads under ``DIR/.cache/huggingface`` and
resumes them on the next run. Network failures end the script with one sentence on stderr and exit code 1;
before the first download the hub's host (or the HTTPS proxy) is reached once with a short timeout, so an
offline machine fails at once instead of through huggingface_hub's retries (about 24 s); the folder is created
only then, and the lock file huggingface_hub takes per download is removed after it.
"""
import argparse
import errno
import shutil
import socket
import sys
import urllib.parse
import urllib.request
from pathlib import Path

if not __package__:  # run as a script: make `data.shards` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.shards import ShardError, read_header  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
REPO_TYPE = "dataset"
# The dataset holds 103 train shards (fineweb_train_000001.bin .. fineweb_train_000103.bin).
MAX_TRAIN_SHARDS = 103
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"

# Local disk problems are reported as such, not as network failures.
_LOCAL_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT}
# Errors meaning "the hub answered: no such file/repo" (checked by class name: the classes moved between
# huggingface_hub versions). LocalEntryNotFoundError derives from EntryNotFoundError but means "offline".
_MISSING_NAMES = {"EntryNotFoundError", "RemoteEntryNotFoundError", "RepositoryNotFoundError",
                  "RevisionNotFoundError"}
# HTTP client libraries huggingface_hub has used; their exceptions do not all derive from OSError
# (huggingface_hub's own HTTP errors do).
_NETWORK_MODULES = ("requests", "urllib3", "httpx", "httpx2", "httpcore", "aiohttp")


def shard_names(n_train):
    """File names to fetch, in order: the val shard, then train shards 1..n_train."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def _one_line(exc, limit=300):
    """First line of an exception's message (hub errors span several lines), shortened."""
    text = str(exc).strip().splitlines()
    line = text[0].strip().rstrip(".") if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe_failure(exc, name, local_dir):
    """One sentence for a failed download, or None when ``exc`` is not a download/network error."""
    mro_names = {c.__name__ for c in type(exc).__mro__}
    reason = f"{type(exc).__name__}: {_one_line(exc)}"
    if "LocalEntryNotFoundError" not in mro_names and mro_names & _MISSING_NAMES:
        return (f"the Hugging Face hub has no {name} in dataset {REPO_ID} ({reason}); "
                f"the dataset has {MAX_TRAIN_SHARDS} train shards")
    if isinstance(exc, OSError) and exc.errno in _LOCAL_ERRNOS and not isinstance(exc, ConnectionError):
        return f"cannot write {name} into {local_dir}: {reason}; free space or fix permissions there"
    is_network = isinstance(exc, (OSError, TimeoutError)) or any(
        c.__module__.split(".")[0] in _NETWORK_MODULES for c in type(exc).__mro__)
    if is_network:
        return (f"cannot reach the Hugging Face hub to download {name}: {reason}; check the network, or set "
                f"HF_ENDPOINT to a reachable mirror, or copy the shards into {local_dir} by hand "
                f"(HF_HUB_OFFLINE=1 then only verifies them)")
    return None


PROBE_TIMEOUT_S = 5  # a reachable host answers a TCP connect within this; an offline one fails at once


def _mb(path):
    return f"{path.stat().st_size / 1e6:.1f} MB"


def unreachable(endpoint):
    """None when a TCP connection to the hub's host (or to the HTTPS proxy the environment names) opens within
    PROBE_TIMEOUT_S, else the reason in a few words."""
    url = urllib.parse.urlsplit(urllib.request.getproxies().get("https") or endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{host}:{port}: {type(exc).__name__}: {_one_line(exc)}"
    return None


def _fetch(hf_hub_download, local_dir, name):
    """hf_hub_download of one shard into local_dir; the lock file it takes there (and leaves behind, even when it
    fails) is removed."""
    try:
        return Path(hf_hub_download(repo_id=REPO_ID, filename=name, repo_type=REPO_TYPE, local_dir=local_dir))
    finally:
        (local_dir / ".cache" / "huggingface" / "download" / f"{name}.lock").unlink(missing_ok=True)


def download(n_train, local_dir):
    """Fetch and verify the shards; return the process exit code (0 ok, 1 failure)."""
    from huggingface_hub import constants, hf_hub_download  # lazy: --help and tests work without it / with a fake

    local_dir = Path(local_dir)
    names = shard_names(n_train)
    checked = constants.HF_HUB_OFFLINE  # offline mode: huggingface_hub only looks at local files
    for k, name in enumerate(names, start=1):
        path = local_dir / name
        prefix = f"[{k}/{len(names)}] {name} ..."
        if path.exists():
            try:
                read_header(path)
                print(f"{prefix} present, ok ({_mb(path)})", flush=True)
                continue
            except (ShardError, OSError) as exc:
                print(f"{prefix} present but invalid ({exc}); downloading it again", flush=True)
                path.unlink()
        if not checked:
            reason = unreachable(constants.ENDPOINT)
            if reason is not None:
                print(f"error: cannot reach the Hugging Face hub to download {name}: {reason}; check the network, "
                      f"or set HF_ENDPOINT to a reachable mirror, or copy the shards into {local_dir} by hand "
                      f"(HF_HUB_OFFLINE=1 then only verifies them)", file=sys.stderr)
                return 1
            checked = True
        local_dir.mkdir(parents=True, exist_ok=True)
        try:
            got = _fetch(hf_hub_download, local_dir, name)
        except Exception as exc:
            message = _describe_failure(exc, name, local_dir)
            if message is None:
                raise  # not a download problem: a bug, keep the traceback
            print(f"error: {message}", file=sys.stderr)
            return 1
        # hf_hub_download returns local_dir/name; copy if some version hands back another location.
        if got.resolve() != path.resolve():
            shutil.copyfile(got, path)
        try:
            read_header(path)
        except (ShardError, OSError) as exc:
            path.unlink(missing_ok=True)
            print(f"error: downloaded {name} is corrupt and was deleted ({exc}); run the script again to retry",
                  file=sys.stderr)
            return 1
        print(f"{prefix} ok ({_mb(path)})", flush=True)
    print(f"{len(names)} shards ready in {local_dir}")
    return 0


def _n_train(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"N must be an integer, got {text!r}") from None
    if not 1 <= n <= MAX_TRAIN_SHARDS:
        raise argparse.ArgumentTypeError(f"N must be in 1..{MAX_TRAIN_SHARDS} (the dataset has "
                                         f"{MAX_TRAIN_SHARDS} train shards), got {n}")
    return n


def build_parser():
    parser = argparse.ArgumentParser(
        prog="cached_fineweb10B.py",
        description=f"Download fineweb_val_000000.bin and fineweb_train_000001.bin .. fineweb_train_<N>.bin "
                    f"(about 100M GPT-2 tokens, ~200 MB each) from the Hugging Face dataset {REPO_ID}.",
        epilog="Files already present and valid are skipped, invalid ones are downloaded again, and every "
               "download is verified. Interrupted downloads resume: huggingface_hub keeps the partial file "
               "under DIR/.cache/huggingface and continues it on the next run. Set HF_ENDPOINT to use a mirror.")
    parser.add_argument("n", metavar="N", type=_n_train,
                        help=f"number of train shards, 1..{MAX_TRAIN_SHARDS} (e.g. 9: ~900M train tokens, ~1.8 GB)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="destination folder (default: data/fineweb10B next to this script)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return download(args.n, args.dir)
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
