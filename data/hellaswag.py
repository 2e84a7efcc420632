"""HellaSwag validation set: download, verify, load, and render examples into GPT-2 tokens.

    python data/hellaswag.py                 # -> data/hellaswag/hellaswag_val.jsonl (10,042 examples)
    python data/hellaswag.py --dir /scratch/hellaswag

Source: ``data/hellaswag_val.jsonl`` of the dataset authors' repository github.com/rowanz/hellaswag, read at
the pinned commit ``COMMIT``, so the bytes are fixed: the download is checked against the file's git blob id
(sha1 of ``b"blob <size>\\0" + content``), its line count and the fields of every line.

Behaviour: a file already present and valid is skipped. A download goes to ``hellaswag_val.jsonl.part`` and
is renamed only once verified; an interrupted download keeps the ``.part`` file and the next run asks the
server for the rest (HTTP Range) and appends it. A complete download that fails verification is deleted.
Network failures end the command line with one sentence on stderr and exit code 2.

Example (one JSON object per line; fields used here): ``ctx`` (the context text), ``endings`` (4 candidate
continuations), ``label`` (index of the right one). ``render`` turns one into token ids the way the public
GPT-2 evaluation (build-nanogpt) does: the context as is, every ending with a leading space; train_gpt.py adds
the BOS token that starts every document and scores the endings (``--hellaswag``).
"""
import argparse
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

COMMIT = "6774d74db0a963013d28bd9323c32de8dd506038"
DEFAULT_DIR = Path(__file__).resolve().parent / "hellaswag"
CHUNK = 1 << 16  # bytes per read while downloading


@dataclass(frozen=True)
class Source:
    name: str  # file name, locally and in the repository's data/ folder
    url: str
    examples: int  # lines of the file, one example each
    git_blob_sha1: str  # sha1 of b"blob <size>\0" + content: the id git gives the file


VAL = Source("hellaswag_val.jsonl",
             f"https://raw.githubusercontent.com/rowanz/hellaswag/{COMMIT}/data/hellaswag_val.jsonl",
             10_042, "0f5ee25d72216f12317d5d8a7b92deafa423d81e")


class HellaSwagError(ValueError):
    """A missing, malformed or undownloadable file: one sentence naming it (train_gpt.py exits 2 on it)."""


@dataclass(frozen=True)
class Example:
    ctx: str  # context, to be continued
    endings: tuple  # 4 candidate continuations (str)
    label: int  # index of the right ending


# ----------------------------------------------------------------------------------------------------------
# Loading and rendering


def parse_examples(text, where):
    """Examples of a jsonl text; a malformed line raises HellaSwagError naming ``where:line``."""
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise HellaSwagError(f"{where}:{i}: not JSON ({e.msg})") from None
        ends = d.get("endings") if isinstance(d, dict) else None
        if not (isinstance(d, dict) and isinstance(d.get("ctx"), str) and isinstance(ends, list) and len(ends) == 4
                and all(isinstance(e, str) and e for e in ends) and type(d.get("label")) is int
                and 0 <= d["label"] < 4):
            raise HellaSwagError(f"{where}:{i}: an example needs 'ctx' (text), 'endings' (4 non-empty texts) "
                                 f"and 'label' (0..3)")
        out.append(Example(d["ctx"], tuple(ends), d["label"]))
    return out


def load_examples(path, limit=0):
    """The first ``limit`` examples of a jsonl file (0: all); HellaSwagError if missing, malformed or empty."""
    path = Path(path)
    if not path.is_file():
        raise HellaSwagError(f"no HellaSwag file at {path}; download it with `python data/hellaswag.py`")
    examples = parse_examples(path.read_text(encoding="utf-8"), path)
    if not examples:
        raise HellaSwagError(f"{path} holds no examples")
    return examples[:limit] if limit > 0 else examples


def render(example, encode):
    """(context ids, [4 ending ids], label): ``encode(ctx)`` and ``encode(" " + ending)``. ``encode`` is a
    tokenizer's plain-text encoder (tiktoken gpt2's ``encode_ordinary``: special-token text stays text)."""
    return encode(example.ctx), [encode(" " + e) for e in example.endings], example.label


# ----------------------------------------------------------------------------------------------------------
# Download


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify(path, source):
    """Raise HellaSwagError unless ``path`` is exactly ``source``'s file (lines, fields, git blob id)."""
    data = Path(path).read_bytes()
    try:
        examples = parse_examples(data.decode("utf-8"), path)
    except UnicodeDecodeError:
        raise HellaSwagError(f"{path} is not UTF-8 text") from None
    if len(examples) != source.examples:
        raise HellaSwagError(f"{path} has {len(examples)} examples, expected {source.examples}")
    if git_blob_sha1(data) != source.git_blob_sha1:
        raise HellaSwagError(f"{path} differs from the published file (git blob {git_blob_sha1(data)[:12]}, "
                             f"expected {source.git_blob_sha1[:12]})")


def _progress(done, total, name):
    if total:
        print(f"\r{name}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({100 * done // total}%)", end="",
              file=sys.stderr, flush=True)


def download(dest_dir=DEFAULT_DIR, source=VAL, opener=urllib.request.urlopen):
    """Make ``dest_dir/source.name`` present and verified; return its path. HellaSwagError on failure.

    ``opener(request, timeout=...)`` returns a response with ``.status``, ``.headers`` and ``.read(n)``
    (urllib's; tests pass a fake)."""
    dest_dir = Path(dest_dir)
    path, part = dest_dir / source.name, dest_dir / (source.name + ".part")
    if path.exists():
        try:
            verify(path, source)
            print(f"{path}: present, ok ({source.examples} examples)")
            return path
        except HellaSwagError as e:
            print(f"{path}: present but invalid ({e}); downloading it again")
            path.unlink()
    dest_dir.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(source.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        try:
            resp = opener(request, timeout=60)
        except urllib.error.HTTPError as e:
            if e.code != 416 or not have:  # 416: nothing after byte `have`, the .part is already whole
                raise
            resp = None
        if resp is not None:
            resumed = have and resp.status == 206
            if have and not resumed:
                print(f"{part}: the server does not resume; starting again", file=sys.stderr)
            done = have if resumed else 0
            length = resp.headers.get("Content-Length")
            total = done + int(length) if length else None
            with open(part, "ab" if resumed else "wb") as f:
                while chunk := resp.read(CHUNK):
                    f.write(chunk)
                    done += len(chunk)
                    _progress(done, total, source.name)
            if total:
                print(file=sys.stderr)
            if total and done < total:
                raise HellaSwagError(f"the download of {source.url} stopped at {done} of {total} bytes; "
                                     f"run the same command again to resume it ({part} is kept)")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", None) or e
        raise HellaSwagError(f"cannot download {source.url} ({type(e).__name__}: {reason}); check the network, "
                             f"or copy {source.name} into {dest_dir} by hand"
                             + (f" (the partial {part.name} is kept: the next run resumes it)"
                                if part.exists() and part.stat().st_size else "")) from None
    try:
        verify(part, source)
    except HellaSwagError as e:
        part.unlink()
        raise HellaSwagError(f"the downloaded file failed verification and was deleted: {e}") from None
    os.replace(part, path)
    print(f"{path}: ok ({source.examples} examples)")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="hellaswag.py", description=f"Download and verify the HellaSwag validation "
                                f"set ({VAL.examples} examples) from github.com/rowanz/hellaswag.",
                                epilog="A valid file already present is kept; an interrupted download resumes.")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="destination folder (default: data/hellaswag)")
    args = p.parse_args(argv)
    try:
        download(args.dir)
    except HellaSwagError as e:
        print(f"hellaswag.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
