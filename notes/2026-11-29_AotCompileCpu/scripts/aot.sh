#!/bin/bash
# Usage: bash .anchor/s71/aot.sh BUDGET_S   (the device's tree: branch aotcache checked out)
# Issue 51 with --compile-cache's whole functions (compilation.Precompiled), the short schedule at world size 1:
#   cold:    empty inductor/Triton caches (/tmp/ind_aot), empty --compile-cache /tmp/cc: compiles and saves
#   loaded:  empty inductor/Triton caches of its own (/tmp/ind_aotB), loads /tmp/cc (a moved cache, page cache warm)
#   loaded2: the same again (its second start on those caches)
#   warm:    no --compile-cache, on cold's inductor cache: today's warm path, for comparison
# Prints per run: launch to step-0 val, startup_s, compile_warmup_s, the precompiled: and compile_cache: lines,
# stage_step_avg; then /tmp/cc's size by folder and packed with xz.
source .anchor/s68/common.sh
budget=$1
job() { local name=$1 tag=$2 lim=$3; shift 3
  local left=$((budget - SECONDS)); [ $left -lt $lim ] && lim=$left
  [ $lim -lt 90 ] && { echo "no time for $name ($lim s)"; return 1; }
  runin $R $name $lim $tag "${SHORT[@]}" "$@"
  local log=$OUT/q/$name.console
  awk -v n=$name 'NR==1{t0=$2} /step:0\/[0-9]* val_loss/{printf "%s: launch to step-0 val %.1f s\n", n, $1-t0; exit}' $log
  grep -h 'precompiled: \|compile_cache\|compile_options\|compile_warmup_s\|Error\|error:' $log | cut -c19- | cut -c1-260 | head -20; }
job cold aot 320 --compile-cache /tmp/cc || exit 0
du -sh /tmp/cc/* 2>&1; ls -la /tmp/cc/aot/*/ 2>&1 | head
XZ_OPT=-T0 tar -C /tmp/cc -cJf $OUT/cc.tar.xz . && ls -la $OUT/cc.tar.xz  # for fresh_load.sh: copy to .anchor/s71/
job loaded aotB 200 --compile-cache /tmp/cc || exit 0
job loaded2 aotB 150 --compile-cache /tmp/cc || exit 0
job warm aot 150 || exit 0
