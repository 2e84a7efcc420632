"""Tests for data/prepare_text.py, offline: a tiny byte-level tiktoken encoding stands in for gpt2.

With the byte-level encoding a document's tokens are its UTF-8 bytes, so expected shard contents can be
written down by hand. One test uses the real gpt2 files when they are available locally, and is skipped
otherwise.
"""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from data import prepare_text as pt
from data.shards import load_shard, shard_files

EOT = 50256
REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "data" / "prepare_text.py"
# sha1 of the two gpt2 URLs: the names under which tiktoken caches vocab.bpe and encoder.json.
GPT2_CACHE_FILES = ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")


def byte_encoding(special=EOT):
    return tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": special})


def doc(text):
    return [EOT] + list(text.encode("utf-8"))


def run(argv, capsys, encoding=None):
    """main() with the byte encoding; returns (exit code, stdout, stderr)."""
    code = pt.main([str(a) for a in argv], encoding=encoding or byte_encoding())
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err):
    """The last line of stderr (tqdm's progress bar, redrawn with \\r, may precede it)."""
    return re.split(r"[\r\n]", err.strip())[-1]


def summary(out):
    """{split: (tokens, documents, shards)} parsed from the printed summary."""
    found = {}
    for m in re.finditer(r"^(val|train)\s+([\d,]+) tokens\s+([\d,]+) documents\s+(\d+) shards", out, re.M):
        found[m[1]] = tuple(int(g.replace(",", "")) for g in m.groups()[1:])
    return found


def tokens_of(out_dir, split, name="fineweb"):
    files = sorted(Path(out_dir).glob(f"{name}_{split}_*.bin"))
    return [load_shard(f).tolist() for f in files]


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_folder_recursion_order_eot_and_skips(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "a.txt", "ab")
    write(src / "sub" / "b.md", "c")
    write(src / "sub" / "deeper" / "c.py", "dé")
    write(src / "z.txt", "z")
    write(src / ".hidden" / "x.txt", "hidden dir")
    write(src / ".dotfile", "hidden file")
    write(src / "bin.dat", b"GIF\x00\x01")
    write(src / "latin1.txt", "caf\xe9".encode("latin-1"))
    write(src / "empty.txt", "")
    (src / "broken").symlink_to(src / "missing-target")
    code, out, err = run([src, "--out", tmp_path / "out", "--val-fraction", 0], capsys)
    assert code == 0, err
    # os.walk order: a folder's files (sorted), then its subfolders (sorted), depth first.
    assert tokens_of(tmp_path / "out", "train") == [doc("ab") + doc("z") + doc("c") + doc("dé")]
    assert tokens_of(tmp_path / "out", "val") == []
    assert summary(out) == {"val": (0, 0, 0), "train": (11, 4, 1)}
    assert "skipped 1 unreadable files, 2 binary or non-UTF-8 files, 1 empty documents (of 8 files)" in out


def test_jsonl_records_and_text_field(tmp_path, capsys):
    f = write(tmp_path / "c.jsonl", '{"body": "hi", "text": "ignored"}\n\n{"body": "yo"}\n{"body": ""}\n')
    write(tmp_path / "d.txt", "plain")
    code, out, err = run([f, tmp_path / "d.txt", "--out", tmp_path / "out", "--val-fraction", 0,
                          "--text-field", "body"], capsys)
    assert code == 0, err
    assert tokens_of(tmp_path / "out", "train") == [doc("hi") + doc("yo") + doc("plain")]
    assert "1 empty documents" in out


def _docs_of(shard_tokens):
    """Split a concatenation of shards back into document texts at the EOT tokens."""
    flat = [t for shard in shard_tokens for t in shard]
    docs, cur = [], None
    for t in flat:
        if t == EOT:
            if cur is not None:
                docs.append(bytes(cur).decode())
            cur = []
        else:
            cur.append(t)
    if cur is not None:
        docs.append(bytes(cur).decode())
    return docs


def _expected_val(identity, fraction):
    """The documented rule, written out independently of the module."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "big") < fraction * 2**64


def test_split_is_deterministic_and_depends_only_on_identity(tmp_path, capsys):
    a = tmp_path / "a"
    for i in range(40):
        write(a / f"f{i:02d}.txt", f"doc{i}")
    code, out, err = run([a, "--out", tmp_path / "out1", "--val-fraction", 0.3], capsys)
    assert code == 0, err
    val1, train1 = _docs_of(tokens_of(tmp_path / "out1", "val")), _docs_of(tokens_of(tmp_path / "out1", "train"))
    assert val1 and train1 and len(val1) + len(train1) == 40
    assert set(val1) == {f"doc{i}" for i in range(40) if _expected_val(f"f{i:02d}.txt", 0.3)}

    # Same inputs again: byte-identical shards.
    run([a, "--out", tmp_path / "out2", "--val-fraction", 0.3], capsys)
    for split in ("val", "train"):
        for x, y in zip(shard_files(tmp_path / "out1" / f"fineweb_{split}_*.bin"),
                        shard_files(tmp_path / "out2" / f"fineweb_{split}_*.bin")):
            assert x.read_bytes() == y.read_bytes()

    # The same documents in another folder, given with extra documents before them: same assignment.
    b = tmp_path / "elsewhere" / "b"
    for i in range(40):
        write(b / f"f{i:02d}.txt", f"doc{i}")
    for i in range(25):
        write(tmp_path / "extra" / f"e{i:02d}.txt", f"extra{i}")
    code, out, err = run([tmp_path / "extra", b, "--out", tmp_path / "out3", "--val-fraction", 0.3], capsys)
    assert code == 0, err
    val3 = [d for d in _docs_of(tokens_of(tmp_path / "out3", "val")) if d.startswith("doc")]
    assert val3 == val1


def test_jsonl_identity_is_path_and_line(tmp_path, capsys):
    lines = [f'{{"text": "r{i}"}}' for i in range(30)]
    f = write(tmp_path / "recs.jsonl", "\n".join(lines) + "\n")
    code, out, err = run([f, "--out", tmp_path / "out", "--val-fraction", 0.4], capsys)
    assert code == 0, err
    val = _docs_of(tokens_of(tmp_path / "out", "val"))
    assert val == [f"r{i}" for i in range(30) if _expected_val(f"recs.jsonl:{i + 1}", 0.4)]


def test_sharding_cuts_at_document_boundaries(tmp_path, capsys):
    src = tmp_path / "src"
    # Documents of 4, 4, 4, 25, 3 and 10 tokens (EOT included) into shards of at most 10 tokens.
    texts = ["aaa", "bbb", "ccc", "d" * 24, "ee", "f" * 9]
    for i, t in enumerate(texts):
        write(src / f"{i}.txt", t)
    code, out, err = run([src, "--out", tmp_path / "out", "--val-fraction", 0, "--shard-tokens", 10], capsys)
    assert code == 0, err
    shards = tokens_of(tmp_path / "out", "train")
    # [a b] (c does not fit) | [c + 6 of d] (d is longer than a shard: split) | [10 of d] | [9 of d] (e does not
    # fit) | [e] (f does not fit) | [f] (exactly one shard).
    assert [len(s) for s in shards] == [8, 10, 10, 9, 3, 10]
    assert sum(shards, []) == sum((doc(t) for t in texts), [])
    names = [p.name for p in shard_files(tmp_path / "out" / "fineweb_train_*.bin")]
    assert names == [f"fineweb_train_{i:06d}.bin" for i in range(1, 7)]
    assert summary(out)["train"] == (50, 6, 6)


def test_val_spills_into_more_shards_and_counts_are_printed(tmp_path, capsys):
    src = tmp_path / "src"
    for i in range(60):
        write(src / f"{i:02d}.txt", "x" * (i % 7 + 1))
    code, out, err = run([src, "--out", tmp_path / "out", "--val-fraction", 0.5, "--shard-tokens", 16,
                          "--name", "mine"], capsys)
    assert code == 0, err
    got = summary(out)
    for split, first in (("val", 0), ("train", 1)):
        files = shard_files(tmp_path / "out" / f"mine_{split}_*.bin")
        assert [f.name for f in files] == [f"mine_{split}_{i:06d}.bin" for i in range(first, first + len(files))]
        tokens = [load_shard(f) for f in files]
        n_docs = sum(int((t == EOT).sum()) for t in tokens)
        assert got[split] == (sum(t.size for t in tokens), n_docs, len(files))
        assert len(files) > 1 and all(t.size <= 16 for t in tokens)
    assert got["val"][1] + got["train"][1] == 60


def test_workers_do_not_change_the_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pt, "BATCH_DOCS", 7)  # several batches, each spread over the threads
    src = tmp_path / "src"
    for i in range(50):
        write(src / f"{i:02d}.txt", f"document number {i} " * (i % 5 + 1))
    for workers in (1, 4):
        code, out, err = run([src, "--out", tmp_path / f"w{workers}", "--val-fraction", 0.2, "--workers", workers,
                              "--shard-tokens", 200], capsys)
        assert code == 0, err
    for split in ("val", "train"):
        assert tokens_of(tmp_path / "w1", split) == tokens_of(tmp_path / "w4", split)


def test_refuses_to_overwrite_unless_force(tmp_path, capsys):
    src = tmp_path / "src"
    for i in range(5):
        write(src / f"{i}.txt", "abcdefgh")
    out_dir = tmp_path / "out"
    code, _, err = run([src, "--out", out_dir, "--val-fraction", 0, "--shard-tokens", 9], capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert len(before) == 5

    code, out, err = run([src, "--out", out_dir, "--val-fraction", 0], capsys)
    assert code == 2
    assert "already holds 5 shard(s) named fineweb_*.bin" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before

    # Another name in the same folder is fine; --force replaces, leaving no stale shards of the old run.
    code, _, err = run([src, "--out", out_dir, "--val-fraction", 0, "--name", "other"], capsys)
    assert code == 0, err
    code, _, err = run([src, "--out", out_dir, "--val-fraction", 0, "--force"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out_dir.glob("fineweb_*.bin")) == ["fineweb_train_000001.bin"]
    assert len(list(out_dir.glob("other_*.bin"))) == 1


@pytest.mark.parametrize("setup", ["empty_dir", "only_binary", "only_empty_jsonl"])
def test_empty_input_is_a_clear_error(tmp_path, capsys, setup):
    src = tmp_path / "src"
    src.mkdir()
    if setup == "only_binary":
        write(src / "x.bin", b"\x00\x01\x02")
    elif setup == "only_empty_jsonl":
        write(src / "x.jsonl", '\n{"text": ""}\n')
    code, out, err = run([src, "--out", tmp_path / "out" / "shards"], capsys)
    assert code == 2
    assert error_line(err).startswith(f"error: no documents found in {src}")
    assert not (tmp_path / "out").exists(), "a failed run leaves no folder it created"


def test_failure_keeps_an_output_folder_that_existed(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    out = tmp_path / "out"
    write(out / "notes.txt", "mine")
    code, _, err = run([tmp_path / "src", "--out", out], capsys)
    assert code == 2 and "no documents found" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run([tmp_path / "src", "--out", empty], capsys)[0] == 2
    assert empty.is_dir(), "a folder that existed before the run is not removed, even when empty"


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    code, out, err = run([tmp_path / "nope", "--out", tmp_path / "out"], capsys)
    assert code == 2 and f"input {tmp_path / 'nope'} does not exist" in err


@pytest.mark.parametrize("line, match", [
    ('{"text": "ok"', r"malformed JSON"),
    ('["text"]', r"record has no string field 'text'"),
    ('{"txt": "a"}', r"record has no string field 'text'"),
    ('{"text": 5}', r"record has no string field 'text'"),
])
def test_malformed_jsonl_names_file_and_line_and_leaves_no_shards(tmp_path, capsys, monkeypatch, line, match):
    monkeypatch.setattr(pt, "BATCH_DOCS", 1)  # tokenize (and write shards) before the bad line is reached
    write(tmp_path / "a.txt", "some text before the bad record")
    f = write(tmp_path / "b.jsonl", '{"text": "fine"}\n' + line + "\n")
    code, out, err = run([tmp_path / "a.txt", f, "--out", tmp_path / "out", "--val-fraction", 0,
                          "--shard-tokens", 4], capsys)
    assert code == 2
    assert re.match(rf"error: {re.escape(str(f))}:2: {match}", error_line(err)), err
    assert not (tmp_path / "out").exists(), "shards and the folder this run made are removed"


def test_empty_split_is_an_error(tmp_path, capsys):
    write(tmp_path / "only.txt", "one document")
    expect_val = _expected_val("only.txt", 0.5)
    code, out, err = run([tmp_path / "only.txt", "--out", tmp_path / "out", "--val-fraction", 0.5], capsys)
    assert code == 2
    missing = "train" if expect_val else "val"
    assert f"no document fell into the {missing} split (1 documents" in err
    assert not (tmp_path / "out").exists(), "shards and the folder this run made are removed"


def test_encoding_must_fit_uint16(tmp_path, capsys):
    write(tmp_path / "a.txt", "x")
    code, out, err = run([tmp_path / "a.txt", "--out", tmp_path / "out"], capsys, encoding=byte_encoding(70000))
    assert code == 2 and "token ids up to 70000" in err


@pytest.mark.parametrize("cache", [None, "empty", "complete"])
def test_tiktoken_offline_error_names_the_files_and_cache_dir(tmp_path, capsys, monkeypatch, cache):
    """Without network and without the tokenizer files: one line, exit code 2, naming the two files, the names
    tiktoken looks for them under (the sha1 of their URLs, as data/README.md lists them) and TIKTOKEN_CACHE_DIR
    (unset, or set to a folder that lacks them). With both files there, another failure keeps tiktoken's reason."""
    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    folder = tmp_path / "cache"
    folder.mkdir()
    if cache is None:
        monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(folder))
    if cache == "complete":
        for name in GPT2_CACHE_FILES:
            write(folder / name, "x")
    write(tmp_path / "a.txt", "x")
    code = pt.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    if cache == "complete":
        assert err == (f"error: cannot load tiktoken's gpt2 files from TIKTOKEN_CACHE_DIR={folder} (ConnectionError: "
                       f"Failed to resolve 'openaipublic.blob.core.windows.net')\n")
        return
    where = "TIKTOKEN_CACHE_DIR is not set" if cache is None else f"TIKTOKEN_CACHE_DIR={folder} lacks them"
    assert err == (f"error: tiktoken's GPT-2 tokenizer files are missing and cannot be downloaded (ConnectionError; "
                   f"{where}): put vocab.bpe as 6d1cbeee0f20b3d9449abfede4726ed8212e3aee and encoder.json as "
                   f"6c7ea1a7e38e3a7f062df639a5b80947f075ffe6 into a folder and set TIKTOKEN_CACHE_DIR to it "
                   f"(see data/README.md)\n")


@pytest.mark.parametrize("args, match", [
    (["--val-fraction", "1"], "F out of range"), (["--val-fraction", "-0.1"], "F out of range"),
    (["--shard-tokens", "0"], "N out of range"), (["--workers", "0"], "K out of range"),
    (["--name", "a/b"], "NAME must be"),
])
def test_bad_options(tmp_path, capsys, args, match):
    with pytest.raises(SystemExit) as info:
        pt.main([str(tmp_path), "--out", str(tmp_path / "out"), *args], encoding=byte_encoding())
    assert info.value.code == 2 and match in capsys.readouterr().err


def _gpt2_cache_dir():
    candidates = [os.environ.get("TIKTOKEN_CACHE_DIR"), REPO_ROOT.parent / "shared" / "tiktoken_cache"]
    for c in candidates:
        if c and all((Path(c) / f).is_file() for f in GPT2_CACHE_FILES):
            return Path(c)
    return None


@pytest.mark.skipif(_gpt2_cache_dir() is None,
                    reason="tiktoken's gpt2 files are not available offline (set TIKTOKEN_CACHE_DIR to run this)")
def test_real_gpt2_encoding(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(_gpt2_cache_dir()))
    write(tmp_path / "src" / "hello.txt", "Hello world")
    code = pt.main([str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--val-fraction", "0"])
    assert code == 0, capsys.readouterr().err
    assert tokens_of(tmp_path / "out", "train") == [[50256, 15496, 995]]


def test_runs_as_script_from_anywhere(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "TIKTOKEN_CACHE_DIR" in proc.stdout and "--shard-tokens" in proc.stdout


def test_shard_writer_direct(tmp_path):
    """The packing rule on its own, including a document exactly one shard long after a partial shard."""
    w = pt.ShardWriter(tmp_path, "t", "train", 1, capacity=5)
    for n in (2, 5, 1, 1, 3, 12):
        w.add(np.full(n, n, dtype=np.uint16))
    w.flush()
    sizes = [load_shard(p).size for p in w.paths]
    assert sizes == [2, 5, 5, 5, 5, 2]
    assert np.concatenate([load_shard(p) for p in w.paths]).tolist() == sum(([n] * n for n in (2, 5, 1, 1, 3, 12)), [])
    assert (w.n_tokens, w.n_docs) == (24, 6)
    assert [p.name for p in w.paths] == [f"t_train_{i:06d}.bin" for i in range(1, 7)]
