"""Launches per call of each graph compiled into an inductor cache: ``python records/launch_counts.py DIR``.

DIR is an inductor cache folder: ``TORCHINDUCTOR_CACHE_DIR`` (torch's default is ``/tmp/torchinductor_<user>``),
or the ``inductor/`` folder of a ``--compile-cache`` PATH. Every output module that inductor wrote there (a ``.py``
file with a ``call`` function, the Python wrapper that launches one compiled graph's kernels) is one graph: a
forward, or a backward (its ``call`` unpacks ``tangents_*`` arguments). For each, the script counts the launches
in ``call``'s body:
- inductor's own Triton kernels (``triton_poi_*``, ``triton_red_*``, ``triton_per_*``: pointwise, looped
  reductions, persistent reductions), and its other generated ones (``triton_tem_*`` templates and the like);
- other Triton kernels the graph launches by ``.run(`` (ours, from ``torch.library.triton_op``);
- ``extern_kernels.*`` calls (cuBLAS matmuls and the like);
- ``torch.ops.*`` calls (custom ops such as FlashAttention's wrapper and the FP8 head).

Without the C++ wrapper each of these is a call through Python on the host. In a step whose GPU work is short
(stage 0 at world size 1), the host's time to make these calls bounds the step: fewer launches, not faster kernels,
then make the step faster. The table also gives T: the most common leading size of the buffers the graph allocates
(``empty_strided_cuda``) of at least 1024, which is the micro-batch's tokens in our training graphs. Then it lists
the inductor kernels that run most often in each graph (by name without the numeric suffix).

Output: a Markdown table, the largest graphs first (``--top N`` graphs, default all).
"""
import argparse
import collections
import re
import sys
from pathlib import Path

KINDS = ("poi", "red", "per")  # inductor's pointwise, looped reduction, persistent reduction kernels
_CALL = re.compile(r"^( *)def call\((?:self, )?args\):\n", re.M)
_RUN = re.compile(r"^\s*(\w+)\.run\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_OPS = re.compile(r"\btorch\.ops\.([\w.]+)\(")
_ALLOC = re.compile(r"\bempty_strided_cuda\(\((\d+),")


class Usage(ValueError):
    """A bad command line or input folder: one line, exit code 2."""


def call_body(source):
    """The text of the module's ``call`` function (its def line's indentation ends it), or None if it has none."""
    m = _CALL.search(source)
    if m is None:
        return None
    indent, lines = len(m.group(1)), []
    for line in source[m.end():].splitlines():
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line)
    return "\n".join(lines)


def count(source):
    """The launch counts of one output module's source, or None if it is not one (no ``call``)."""
    body = call_body(source)
    if body is None:
        return None
    runs = _RUN.findall(body)
    inductor = [r for r in runs if r.startswith("triton_")]
    by_kind = collections.Counter(r.split("_")[1] if r.split("_")[1] in KINDS else "other" for r in inductor)
    dims = collections.Counter(int(d) for d in _ALLOC.findall(body) if int(d) >= 1024)
    return {
        "backward": bool(re.search(r"\btangents_\d+\b", body)),
        "inductor": len(inductor),
        "by_kind": {k: by_kind.get(k, 0) for k in (*KINDS, "other")},
        "ours": len(runs) - len(inductor),
        "extern": len(_EXTERN.findall(body)),
        "ops": len(_OPS.findall(body)),
        "T": dims.most_common(1)[0][0] if dims else None,
        "names": collections.Counter(re.sub(r"_\d+$", "", r) for r in inductor),
    }


def total(c):
    """All launches of one graph's call: count's four kinds together."""
    return c["inductor"] + c["ours"] + c["extern"] + c["ops"]


def scan(folder):
    """[(path relative to folder, counts)] of every output module under folder, the most launches first."""
    folder = Path(folder)
    if not folder.is_dir():
        raise Usage(f"launch_counts: {folder}: not a folder (give an inductor cache folder)")
    found = []
    for path in sorted(folder.rglob("*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            raise Usage(f"launch_counts: {path}: cannot read ({e.strerror})") from None
        c = count(text)
        if c is not None:
            found.append((path.relative_to(folder).as_posix(), c))
    if not found:
        raise Usage(f"launch_counts: {folder}: no inductor output module (a .py file with a call function) in it")
    found.sort(key=lambda pc: -total(pc[1]))
    return found


def table(found, top=None, names=5):
    """Markdown lines for scan's result."""
    lines = ["| graph | kind | T | inductor Triton (poi / red / per / other) | other .run | extern | torch.ops | "
             "all |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    shown = found[:top] if top else found
    for path, c in shown:
        k = c["by_kind"]
        lines.append(f"| `{path}` | {'backward' if c['backward'] else 'forward'} | {c['T'] or '-'} | "
                     f"{c['inductor']} ({k['poi']} / {k['red']} / {k['per']} / {k['other']}) | {c['ours']} | "
                     f"{c['extern']} | {c['ops']} | {total(c)} |")
    for path, c in shown:
        if names and c["names"]:
            common = ", ".join(f"{n} {k}" for n, k in c["names"].most_common(names))
            lines.append(f"- `{path}`: {common}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an inductor cache folder")
    parser.add_argument("--top", type=int, default=None, help="show the N graphs with the most launches")
    parser.add_argument("--names", type=int, default=5, help="inductor kernel names listed per graph (0: none)")
    args = parser.parse_args(argv)
    try:
        if args.top is not None and args.top < 1:
            raise Usage(f"launch_counts: --top must be at least 1, got {args.top}")
        if args.names < 0:
            raise Usage(f"launch_counts: --names must be at least 0, got {args.names}")
        print("\n".join(table(scan(args.folder), args.top, args.names)))
    except Usage as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
