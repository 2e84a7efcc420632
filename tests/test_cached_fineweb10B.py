"""Tests for data/cached_fineweb10B.py with a fake ``huggingface_hub.hf_hub_download`` (no network)."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
import numpy as np
import pytest

from data import cached_fineweb10B as dl
from data.shards import HEADER_BYTES, load_shard, write_shard

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "data" / "cached_fineweb10B.py"


def _tokens_for(name):
    """Small distinct token content per file, so a test can tell which file holds what."""
    return np.arange(5, dtype=np.int64) + sum(map(ord, name))


class FakeHub:
    """Stands in for hf_hub_download: records calls and writes what `behaviour(name)` says."""

    def __init__(self, behaviour=lambda name: "ok"):
        self.behaviour = behaviour
        self.calls = []

    def __call__(self, repo_id, filename, *, repo_type=None, local_dir=None, **kwargs):
        self.calls.append(filename)
        assert (repo_id, repo_type) == ("kjj0/fineweb10B-gpt2", "dataset")
        path = Path(local_dir) / filename
        what = self.behaviour(filename)
        if what == "ok":
            write_shard(path, _tokens_for(filename))
        elif what == "truncated":
            write_shard(path, _tokens_for(filename))
            with open(path, "r+b") as f:
                f.truncate(HEADER_BYTES + 4)
        elif isinstance(what, BaseException):
            raise what
        return str(path)


@pytest.fixture
def fake_hub(monkeypatch):
    def install(behaviour=lambda name: "ok"):
        fake = FakeHub(behaviour)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
        monkeypatch.setattr(dl, "unreachable", lambda endpoint: None)  # the hub answers (no network used)
        return fake
    return install


def test_shard_names():
    assert dl.shard_names(2) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert dl.shard_names(103)[-1] == "fineweb_train_000103.bin"


def test_downloads_val_and_n_train_shards(tmp_path, fake_hub, capsys):
    fake = fake_hub()
    assert dl.main(["3", "--dir", str(tmp_path / "fw")]) == 0
    names = dl.shard_names(3)
    assert fake.calls == names
    for name in names:
        assert np.array_equal(load_shard(tmp_path / "fw" / name), _tokens_for(name))
    out = capsys.readouterr().out
    assert "[1/4] fineweb_val_000000.bin ... ok (0.0 MB)" in out
    assert "[4/4] fineweb_train_000003.bin ... ok (0.0 MB)" in out


def test_valid_present_file_is_skipped(tmp_path, fake_hub, capsys):
    write_shard(tmp_path / "fineweb_train_000001.bin", [7, 8, 9])
    fake = fake_hub()
    assert dl.main(["2", "--dir", str(tmp_path)]) == 0
    assert fake.calls == ["fineweb_val_000000.bin", "fineweb_train_000002.bin"]
    assert load_shard(tmp_path / "fineweb_train_000001.bin").tolist() == [7, 8, 9]
    assert "[2/3] fineweb_train_000001.bin ... present, ok" in capsys.readouterr().out


def test_invalid_present_file_is_downloaded_again(tmp_path, fake_hub, capsys):
    bad = tmp_path / "fineweb_val_000000.bin"
    bad.write_bytes(b"not a shard")
    fake = fake_hub()
    assert dl.main(["1", "--dir", str(tmp_path)]) == 0
    assert fake.calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert np.array_equal(load_shard(bad), _tokens_for(bad.name))
    out = capsys.readouterr().out
    assert "fineweb_val_000000.bin ... present but invalid" in out and "shorter than the 1024-byte header" in out


def test_corrupt_download_is_deleted_and_exits_nonzero(tmp_path, fake_hub, capsys):
    fake = fake_hub(lambda name: "truncated" if name == "fineweb_train_000001.bin" else "ok")
    assert dl.main(["2", "--dir", str(tmp_path)]) == 1
    assert fake.calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]  # stops at the bad one
    assert not (tmp_path / "fineweb_train_000001.bin").exists()
    assert (tmp_path / "fineweb_val_000000.bin").exists()
    err = capsys.readouterr().err
    assert "downloaded fineweb_train_000001.bin is corrupt and was deleted" in err and "truncated" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("exc", [
    ConnectionError("Name or service not known"),
    TimeoutError("read timed out"),
    OSError("Network is unreachable"),
    LocalEntryNotFoundError("cannot find the requested files in the local cache.\nmore"),
])
def test_network_failure_is_one_sentence(tmp_path, fake_hub, capsys, exc):
    fake_hub(lambda name: exc)
    assert dl.main(["1", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: cannot reach the Hugging Face hub to download fineweb_val_000000.bin: "
                               f"{type(exc).__name__}: ")
    assert "HF_ENDPOINT" in lines[0] and "Traceback" not in err


def test_missing_file_on_hub_is_reported_as_such(tmp_path, fake_hub, capsys):
    missing = EntryNotFoundError("404 Client Error: entry not found")
    fake_hub(lambda name: missing)
    assert dl.main(["1", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "the Hugging Face hub has no fineweb_val_000000.bin in dataset kjj0/fineweb10B-gpt2" in err
    assert "cannot reach" not in err


def test_disk_full_is_not_called_a_network_error(tmp_path, fake_hub, capsys):
    import errno
    fake_hub(lambda name: OSError(errno.ENOSPC, "No space left on device"))
    assert dl.main(["1", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write fineweb_val_000000.bin into {tmp_path}" in err and "cannot reach" not in err


def test_offline_fails_at_once_before_any_download_or_folder(tmp_path, capsys, monkeypatch):
    """No network: one sentence within the probe's time, not huggingface_hub's ~24 s of retries; nothing is
    asked of the hub and no folder is made."""
    fake = FakeHub()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    calls = []

    def no_network(address, timeout=None):
        calls.append((address, timeout))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    t0 = time.perf_counter()
    assert dl.main(["1", "--dir", str(tmp_path / "fw")]) == 1
    assert time.perf_counter() - t0 < 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the Hugging Face hub to download fineweb_val_000000.bin: "
                          "huggingface.co:443: gaierror: [Errno -2] Name or service not known; check the network")
    assert len(err.strip().splitlines()) == 1
    assert calls == [(("huggingface.co", 443), dl.PROBE_TIMEOUT_S)] and fake.calls == []
    assert not (tmp_path / "fw").exists()


def test_no_lock_file_is_left_behind(tmp_path, capsys, monkeypatch):
    """The real hf_hub_download in offline mode (HF_HUB_OFFLINE=1: no probe, no network) takes its lock file in
    DIR/.cache/huggingface/download and fails; the lock is gone afterwards, and after a success too."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert dl.main(["1", "--dir", str(tmp_path)]) == 1
    assert "cannot reach the Hugging Face hub to download fineweb_val_000000.bin" in capsys.readouterr().err
    assert (tmp_path / ".cache" / "huggingface" / "download").is_dir(), "huggingface_hub's lock folder"
    assert list(tmp_path.rglob("*.lock")) == []

    def leaves_lock(repo_id, filename, *, repo_type=None, local_dir=None):
        lock = Path(local_dir) / ".cache" / "huggingface" / "download" / f"{filename}.lock"
        lock.touch()
        write_shard(Path(local_dir) / filename, _tokens_for(filename))
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", leaves_lock)
    assert dl.main(["1", "--dir", str(tmp_path)]) == 0
    assert list(tmp_path.rglob("*.lock")) == []


def test_unrelated_bug_keeps_its_traceback(tmp_path, fake_hub):
    fake_hub(lambda name: KeyError("a bug, not a download failure"))
    with pytest.raises(KeyError):
        dl.main(["1", "--dir", str(tmp_path)])


@pytest.mark.parametrize("arg, match", [("0", "N must be in 1..103"), ("104", "N must be in 1..103"),
                                        ("x", "N must be an integer")])
def test_n_is_validated(arg, match, capsys, fake_hub):
    fake = fake_hub()
    with pytest.raises(SystemExit) as info:
        dl.main([arg])
    assert info.value.code == 2
    assert match in capsys.readouterr().err
    assert fake.calls == []


@pytest.mark.parametrize("cwd", [REPO_ROOT, "tmp"])
def test_runs_as_script_from_anywhere(tmp_path, cwd):
    """`python data/cached_fineweb10B.py --help` works from the repo root and elsewhere (sys.path set up)."""
    cwd = tmp_path if cwd == "tmp" else cwd
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "kjj0/fineweb10B-gpt2" in proc.stdout and "resume" in proc.stdout
    proc = subprocess.run([sys.executable, str(SCRIPT), "500"], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "N must be in 1..103" in proc.stderr
