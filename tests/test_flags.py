"""Tests of flags.py: flags made from a toy dataclass (types, bools, tuples, aliases, skipped fields, help from
the comments) and the parser's rank-0 errors. The trainer's own flags: test_train_gpt.py."""
import argparse
import dataclasses

import pytest

from flags import ArgumentParser, add_dataclass_flags, field_comments


@dataclasses.dataclass
class Toy:
    steps: int = 3  # how many steps
    lr: float = 0.5  # learning rate
    fast: bool = True  # go fast
    layers: tuple = (1, 2)  # layer indices
    table: tuple = ()  # edited in the code


def _parser():
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, Toy, Toy(), aliases={"steps": ["--n"]}, skip=("table",),
                        shown=lambda name, v: "from elsewhere" if name == "lr" else repr(v))
    return p


def test_flags_are_typed_and_unset_flags_stay_none():
    args = _parser().parse_args(["--n", "7", "--no-fast", "--layers", "4,-1"])
    assert (args.steps, args.lr, args.fast, args.layers) == (7, None, False, (4, -1))
    assert not hasattr(args, "table")


def test_help_is_the_field_comment_and_default(capsys):
    assert field_comments(Toy) == {"steps": "how many steps", "lr": "learning rate", "fast": "go fast",
                                   "layers": "layer indices", "table": "edited in the code"}
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "how many steps (default: 3)" in out and "learning rate (default: from elsewhere)" in out
    assert "--table" not in out


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_usage_errors_print_on_rank_zero_only(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    p = ArgumentParser(prog="toy")
    add_dataclass_flags(p, Toy, Toy())
    with pytest.raises(SystemExit) as info:
        p.parse_args(["--steps", "x"])
    assert info.value.code == 2 and ("argument --steps" in capsys.readouterr().err) == printed
