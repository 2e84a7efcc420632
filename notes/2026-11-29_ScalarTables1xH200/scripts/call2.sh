#!/bin/bash
# warm nvidia-h200 after call1: old and new with --deterministic, cold, at once (their final checkpoints' tensors
# compared), then warm timed runs of the default: new2, old2, new3 (caches of call1).
set -u; A=$(pwd)/.anchor; R=$(pwd); mkdir -p $OUT/q /tmp/logs
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
trap "tar czf \$OUT/logs2.tgz -C /tmp/logs . 2>/dev/null" EXIT
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
echo "corpus ready at $SECONDS s"
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
SHORT=(--steps 60 --extension-steps 4 --val-every 64 --log-train-loss)
runin() { local dir=$1 name=$2 lim=$3 tag=$4; shift 4; local log=$OUT/q/$name.console
  echo "launch $EPOCHREALTIME $name $dir $*" > $log
  ( cd $dir && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tag TRITON_CACHE_DIR=/tmp/tri_$tag timeout -k 5 $lim torchrun --standalone \
    --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" 2>&1 < /dev/null | stamp >> $log )
  echo "end $EPOCHREALTIME" >> $log
  echo "$name at $SECONDS s: $(grep -h 'startup_s\|compile_warmup_s\|stage_step_avg' $log | cut -c19- | cut -c1-160 | tr '\n' ' ')"; }
DET=(--deterministic --steps 24 --extension-steps 2 --val-every 26 --log-train-loss)
rm -rf /tmp/ck/det_*
runin $A/old det_old 290 detold "${DET[@]}" &
runin $R det_new 290 detnew "${DET[@]}" &
wait
python3 - <<'PY' 2>&1 | tee $OUT/q/det_compare.txt
import glob, torch
def load(n):
    fs = sorted(glob.glob(f"/tmp/ck/{n}/step_*/rank0.pt")); print(n, fs[-1:] if fs else "no checkpoint")
    return torch.load(fs[-1], map_location="cpu", weights_only=False) if fs else None
def flat(x, p=""):
    if isinstance(x, torch.Tensor): yield p, x
    elif isinstance(x, dict):
        for k, v in x.items(): yield from flat(v, f"{p}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x): yield from flat(v, f"{p}/{i}")
a, b = load("det_old"), load("det_new")
if a is not None and b is not None:
    ta, tb = dict(flat(a)), dict(flat(b))
    print("tensors", len(ta), len(tb), "same keys", set(ta) == set(tb))
    diff = [k for k in ta if k in tb and not (ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]))]
    print("differing tensors", len(diff), diff[:20])
PY
for n in det_old det_new; do grep -o 'train_loss:[0-9.]*\|val_loss:[0-9.]*' $OUT/q/$n.console | md5sum; done
rm -rf /tmp/ck/det_*
left() { echo $((575 - SECONDS)); }
for vn in new:2 old:2 new:3; do v=${vn%:*}; n=${vn#*:}; d=$R; [ $v = old ] && d=$A/old
  l=$(left); [ $l -lt 105 ] && { echo "no time for $v ($l s)"; break; }
  runin $d $v$n $((l < 140 ? l : 140)) $v "${SHORT[@]}"; rm -rf /tmp/ck/$v$n; done
