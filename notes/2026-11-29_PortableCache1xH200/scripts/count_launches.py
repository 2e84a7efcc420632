"""Launches in one call of an inductor output module (its call() function): python count_launches.py MODULE.py

Counts the Triton kernels inductor launches (.run( of triton_poi/red/per kernels, grouped by kind and by name
without the numeric suffix), other kernels' .run( (our triton_op kernels), extern_kernels.mm and torch.ops calls."""
import collections
import re
import sys

text = open(sys.argv[1]).read()
body = text[text.index("def call(self, args)"):] if "def call(self, args)" in text else text[text.index("def call("):]
runs = re.findall(r"^\s*(\w+)\.run\(", body, re.M)
ours = collections.Counter(r for r in runs if not r.startswith("triton_"))
kinds = collections.Counter(r.split("_")[1] for r in runs if r.startswith("triton_"))
names = collections.Counter(re.sub(r"_\d+$", "", r) for r in runs if r.startswith("triton_"))
print(f"inductor Triton launches: {sum(kinds.values())} ({', '.join(f'{k} {v}' for k, v in kinds.most_common())})")
print(f"other .run launches: {dict(ours)}")
mms = re.findall(r"extern_kernels\.mm\(", body)
ops = collections.Counter(re.findall(r"torch\.ops\.([\w.]+)\(", body))
print(f"extern_kernels.mm: {len(mms)}")
print(f"torch.ops calls: {dict(ops)}")
print("inductor Triton kernels by name (count):")
for name, n in names.most_common(12):
    print(f"  {n:4d}  {name}")
