"""Command-line flags made from a dataclass (train_gpt.py's Hyperparameters), a parser for torchrun, and the
error of a setting that cannot work.

``add_dataclass_flags`` adds one flag per field: --field-name (plus aliases), typed from the field (bools as
--x / --no-x, tuples as comma lists), its help the field's same-line comment in the source (``field_comments``:
each knob is documented once) and its default. Unset flags stay None, so the caller keeps the dataclass's
default. ``ArgumentParser`` prints usage errors on rank 0 only (torchrun starts one process per rank).
``flag_name``: the flag of a field, its short alias (``FLAG_ALIASES``) where it has one. ``SettingsError``: a
setting that cannot work, one line naming the flag (cli.py prints it and exits with code 2); ``check_ranges`` raises
it for the first value outside its bounds.
"""
import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import tokenize


# Short names that users and records use, kept beside the generated --field-name flags.
FLAG_ALIASES = {"scheduled_steps": ["--steps"], "log_train_loss": ["--train-loss"]}


def flag_name(field):
    """The command-line flag of a hyperparameter or argument: its short alias where it has one (--steps)."""
    return FLAG_ALIASES.get(field, ["--" + field.replace("_", "-")])[0]


class SettingsError(ValueError):
    """A setting (a flag, a default it combines with, or the launch) that cannot work; cli.one_line_errors prints
    it as one line naming the flag and exits with code 2."""


def check_ranges(obj, ranges):
    """SettingsError, naming the flag (``flag_name``), for the first field of ``obj`` outside its inclusive bounds;
    ranges: {field: (lo, hi)}, None an open end."""
    for name, (lo, hi) in ranges.items():
        value = getattr(obj, name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rule = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise SettingsError(f"{flag_name(name)}: must be {rule}, got {value}")


def launch_rank():
    """This process's rank as torchrun set it (0 without torchrun), readable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def field_comments(cls):
    """{field: its same-line comment} of the dataclass ``cls``, read from its source."""
    lines, first = inspect.getsourcelines(cls)
    comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                for tok in tokenize.generate_tokens(iter(lines).__next__) if tok.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(textwrap.dedent("".join(lines))).body[0].body:
        if isinstance(node, ast.AnnAssign) and node.end_lineno in comments:
            out[node.target.id] = comments[node.end_lineno]
    return out


def _tuple_parser(elem_type):
    def parse(text):
        try:
            return tuple(elem_type(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {elem_type.__name__}, "
                                             f"got {text!r}") from None
    parse.__name__ = f"{elem_type.__name__} list"
    return parse


def add_dataclass_flags(group, cls, defaults, aliases=None, skip=(), shown=None):
    """One flag per field of the dataclass ``cls`` but ``skip``, added to the argparse (group) ``group``:
    --field-name plus ``aliases[field]``, dest the field's name, default None; the help is the field's comment
    and its value in ``defaults`` (an instance of cls), written by shown(name, value) (default: repr)."""
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        names = ["--" + f.name.replace("_", "-"), *(aliases or {}).get(f.name, [])]
        default = getattr(defaults, f.name)
        text = shown(f.name, default) if shown is not None else repr(default)
        kw = dict(dest=f.name, default=None, help=f"{comments[f.name]} (default: {text})")
        if f.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.type is tuple:
            kw.update(type=_tuple_parser(type(default[0]) if default else int), metavar="A,B,...")
        else:
            kw["type"] = f.type
        group.add_argument(*names, **kw)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are printed by rank 0 only (torchrun starts one process per rank); every
    rank exits with code 2."""

    def error(self, message):
        if launch_rank() == 0:
            super().error(message)
        self.exit(2)
