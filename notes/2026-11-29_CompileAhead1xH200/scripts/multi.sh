#!/bin/bash
# Several jobs at once on one multi-GPU machine (nvidia-h100-x4 / -x2), each on its own GPUs, from the project root
# (carry [".anchor"]). Training logs are side.sh-style: a "launch UNIX_TIME GPU HOST" line, then every
# line prefixed with a Unix time, so .anchor/side_table.py reads them.
# usage: .anchor/multi.sh LIMIT_S JOB...     each JOB one quoted string:
#   'NAME GPUS record'              record #74 (world size = number of GPUs in the comma list GPUS)
#   'NAME GPUS r88'                 record #88 (1.243 min on 8xH100; untried here); 'head' = record #89 (fails here:
#                                   cuBLAS rejects its FP8 down-projection on torch 2.11)
#   'NAME GPUS ours [flags...]'     our train_gpt.py on the code corpus
#   'NAME GPU suite'                bash .ci/gpu_suite (log: $OUT/NAME/gpu_suite.log)
# Output: $OUT/q/NAME.log per job (at most 8 files come back). The corpus is built once per machine under /tmp.
# Example, 4 GPUs, one call: record #74 beside three seeds of ours (cards identical; swap the record's card in the
# next call to cancel card bias), then on the warm machine a world-size-2 pair, or the suite beside runs:
#   .anchor/multi.sh 535 'rec 0 record' 'o0 1 ours --seed 0' 'o1 2 ours --seed 1' 'o2 3 ours --seed 2'
#   .anchor/multi.sh 575 'rec2 0,1 record' 'ours2 2,3 ours --seed 0'
#   GIT_SHA=abc1234 .anchor/multi.sh 560 'rec 1 record' 'o3 0 ours --seed 3' 'suite 2 suite'
# Then on the CPU machine: python3 .anchor/side_table.py OURS_LOG RECORD_LOG
# This copy (2026-11-29) is notes/2026-11-27_WorldSize4x4H200/multi.sh (the record's second validation-shard name
# at world size 4) with two more changes from ../shared/anchor/multi.sh; copy it over .anchor/multi.sh after
# setup.sh. LIM_S counts from this script's start: each job gets what is left of it after the corpus build. Any
# train_gpt.py left running by an earlier call is killed first and last: torchrun starts ranks in sessions of their
# own, and a call's outer timeout that kills torchrun leaves record #74's ranks training (ours end with their
# launcher). The GPUs' compute processes are counted before the jobs start.
set -u
LIM=$1; shift
pkill -f train_gpt.py && sleep 3
echo "compute processes on the GPUs before the jobs: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"
A=$(pwd)/.anchor W=/tmp/multi
mkdir -p $W/root/data $OUT/q
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
ln -sfn /tmp/code $W/root/data/fineweb10B
# the record's warmup reads one validation batch per warmup step (14 x world_size x 262,144 tokens): more than the
# corpus's validation shard at world size 4. A second name of the same shard serves it; validations read the first.
mkdir -p $W/rroot/data/fineweb10B; for f in /tmp/code/*.bin; do ln -sfn $f $W/rroot/data/fineweb10B/; done
ln -sfn /tmp/code/fineweb_val_000000.bin $W/rroot/data/fineweb10B/fineweb_val_000001.bin
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
port=29700
for job in "$@"; do
  read -r -a J <<< "$job"; name=${J[0]} gpus=${J[1]} kind=${J[2]}; flags=("${J[@]:3}")
  n=$(echo "$gpus" | tr ',' '\n' | wc -l); first=${gpus%%,*}; port=$((port + 1)); log=$OUT/q/$name.log
  echo "launch $EPOCHREALTIME $(nvidia-smi --query-gpu=name --format=csv,noheader -i $first) $(hostname) gpus=$gpus job=$kind ${flags[*]}" > $log
  case $kind in
    record|head|r88) (cd $A/$([ $kind = record ] && echo pr233 || echo $kind) && CUDA_VISIBLE_DEVICES=$gpus DATA_PATH=$W/rroot PYTHONPATH=$A/standin timeout -k 5 $((LIM - SECONDS)) \
               torchrun --standalone --master_port=$port --nproc_per_node=$n train_gpt.py 2>&1 < /dev/null | stamp >> $log) & ;;
    ours) (CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 $((LIM - SECONDS)) torchrun --standalone --master_port=$port --nproc_per_node=$n \
             train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
             --log-dir $W/logs/$name --checkpoint-dir $W/ckpt/$name "${flags[@]}" 2>&1 < /dev/null | stamp >> $log) & ;;
    suite) (CUDA_VISIBLE_DEVICES=$gpus GPU_SUITE_TIMEOUT=$((LIM - SECONDS)) GIT_SHA=${GIT_SHA:-?} bash .ci/gpu_suite $OUT/$name "${flags[@]}" > /dev/null 2>&1;
            tail -40 $OUT/$name/gpu_suite.log >> $log) & ;;
    *) echo "unknown job kind $kind" >&2 ;;
  esac
done
wait
pkill -f train_gpt.py
for f in $OUT/q/*.log; do echo "== $f"; grep -E "val_loss|Traceback|Error|error:|passed|failed" $f | tail -8; done
