#!/bin/bash
# #32 check: --deterministic, 20 steps of the default model at commit BEFORE (from .git) and of the working tree,
# checkpoint at step 20 each; compares the step lines and every tensor of the checkpoints bitwise.
# usage: [OUT=DIR] [CORPUS_SCRIPT=PATH] bash det_compare.sh BEFORE_SHA LIMIT_S, from the repository root (git clone).
# Needs the offline code corpus in /tmp/code (fineweb_train_*.bin, fineweb_val_000000.bin). Where it is missing,
# CORPUS_SCRIPT names the team's corpus script (kept outside this repository), run as `python3 CORPUS_SCRIPT
# /tmp/code` (it tokenizes with GPT-2's tokenizer: TIKTOKEN_CACHE_DIR where offline). Logs go to OUT/det
# (default: ./det_out/det); the runs write /tmp/before, /tmp/dck, /tmp/dll and /tmp/cc_det.
set -u
BEFORE=$1; LIM=$2
export OUT=${OUT:-$(pwd)/det_out}; mkdir -p "$OUT/det"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ ! -f /tmp/code/fineweb_val_000000.bin ]; then
  [ -n "${CORPUS_SCRIPT:-}" ] || { echo "det_compare.sh: no corpus in /tmp/code and no CORPUS_SCRIPT" >&2; exit 1; }
  python3 "$CORPUS_SCRIPT" /tmp/code > "$OUT/det/corpus.log" 2>&1 || exit 1
fi
rm -rf /tmp/before /tmp/dck /tmp/dll; mkdir -p /tmp/before
git archive $BEFORE | tar -x -C /tmp/before || exit 1
T0=$SECONDS
run() {  # run NAME DIR
  local log=$OUT/det/$1.log
  (cd $2 && timeout -k 5 $((LIM - (SECONDS - T0) - 30)) torchrun --standalone --nproc_per_node=1 train_gpt.py \
     --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
     --log-dir /tmp/dll --checkpoint-dir /tmp/dck --run-id $1 --deterministic --train-loss --save-every 20 \
     --compile-cache /tmp/cc_det 2>&1 < /dev/null > $log) &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    [ -d /tmp/dck/$1/step_000020 ] && { sleep 2; pkill -f train_gpt.py; break; }
    sleep 1
  done
  wait $pid
  grep -E "compile_warmup_s|compile_cache" $log | head -3
}
run before /tmp/before
run after $(pwd)
python3 - <<'PY'
import re, torch, os
out = os.environ["OUT"] + "/det/"
def steps(name):
    return [re.sub(r" train_time:\S+| step_avg:\S+", "", l.strip()) for l in open(out + name + ".log")
            if re.match(r"step:\d+/\d+ ", l.strip()) and int(l.split("/")[0][5:]) <= 20]
b, a = steps("before"), steps("after")
print(f"step lines: before {len(b)}, after {len(a)}, identical: {b == a}")
for x, y in zip(b, a):
    if x != y: print("  differ:", x, "|", y)
print("last:", a[-1] if a else None)
sb = torch.load("/tmp/dck/before/step_000020/rank0.pt", map_location="cpu", weights_only=False, mmap=True)
sa = torch.load("/tmp/dck/after/step_000020/rank0.pt", map_location="cpu", weights_only=False, mmap=True)
def flat(o, p=""):
    if torch.is_tensor(o): yield p, o
    elif isinstance(o, dict):
        for k, v in o.items(): yield from flat(v, f"{p}/{k}")
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o): yield from flat(v, f"{p}/{i}")
for part in ("params", "optimizer"):
    fb, fa = dict(flat(sb[part])), dict(flat(sa[part]))
    same = [k for k in fb if k in fa and fb[k].shape == fa[k].shape and fb[k].dtype == fa[k].dtype and torch.equal(fb[k], fa[k])]
    print(f"{part}: before {len(fb)} tensors ({sum(t.numel() for t in fb.values())} values), after {len(fa)}; "
          f"bitwise equal: {len(same)}; only before: {sorted(set(fb) - set(fa))[:5]}; only after: {sorted(set(fa) - set(fb))[:5]}")
    for k in [k for k in fb if k in fa and k not in same][:10]:
        print("  differ:", k, tuple(fb[k].shape), tuple(fa[k].shape), fb[k].dtype, fa[k].dtype)
PY
