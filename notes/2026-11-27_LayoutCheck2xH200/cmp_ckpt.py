"""Compare two runs bit for bit: their step/val loss lines and every tensor of their final checkpoints.
usage: python cmp_ckpt.py LOG_A CKPT_A LOG_B CKPT_B   (CKPT: a step_NNNNNN folder or a rank0.pt)"""
import re
import sys
from pathlib import Path

import torch


def flat(x, p=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flat(v, f"{p}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from flat(v, f"{p}[{i}]")
    elif torch.is_tensor(x):
        yield p, x


def lines(log):
    return [re.sub(r" train_time:\S+| step_avg:\S+", "", ln.strip()) for ln in Path(log).read_text().splitlines()
            if re.match(r"^step:\d+/\d+ (val_loss|train_loss|train_time)", ln.strip()) and "loss" in ln]


la, lb = lines(sys.argv[1]), lines(sys.argv[3])
print(f"loss lines: {len(la)} vs {len(lb)}, identical: {la == lb}")
for x, y in zip(la, lb):
    if x != y:
        print("  first difference:", x, "|", y)
        break
ca, cb = (Path(p) / "rank0.pt" if Path(p).is_dir() else Path(p) for p in (sys.argv[2], sys.argv[4]))
ta = dict(flat(torch.load(ca, map_location="cpu", weights_only=False)))
tb = dict(flat(torch.load(cb, map_location="cpu", weights_only=False)))
common = sorted(set(ta) & set(tb))
diff = [k for k in common if not (ta[k].shape == tb[k].shape and ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]))]
print(f"tensors: {len(ta)} vs {len(tb)}, common {len(common)}, differing {len(diff)}")
print("  only in A:", sorted(set(ta) - set(tb))[:10])
print("  only in B:", sorted(set(tb) - set(ta))[:10])
for k in diff[:10]:
    print("  differs:", k)
print("BITWISE IDENTICAL" if la == lb and not diff and len(common) > 0 else "DIFFERENT")
