#!/bin/bash
# Usage: bash .anchor/s73/probe_fresh.sh BUDGET_S [CACHE_TAR] [DIR]   (a FRESH machine; CACHE_TAR: a packed
# --compile-cache from another machine of this kind, default .anchor/s74/cc.tar.xz; DIR: where it is unpacked, default
# /tmp/cc; another path than the filling run's tests that the cache works anywhere, branch cclink)
# Where does a fresh machine's first start on a moved --compile-cache spend the ~35 s its second start does not?
# (2026-11-29: 65.3 s then 28.3 s; with the libraries read ahead 61.0 s then 32.6 s: not the cold disk.)
# Both starts run under a stack sampler (sampler/sitecustomize.py: $OUT/q/stack_NAME.0), and after each start
# every file written on the machine since the one before is counted by folder (what machine-wide state the first
# start leaves for the second: autotuning results, a JIT cache, compiled launchers...).
source .anchor/s72/common2.sh
budget=$1; tarball=${2:-$A/s74/cc.tar.xz}; cc=${3:-/tmp/cc}
sha256sum $tarball; mkdir -p $cc && tar -C $cc -xJf $tarball && du -sh $cc
newfiles() {  # files written since the mark $1, counted by their folder (3 levels), top 25; then the mark moves
  find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path $OUT -o -path /tmp/logs \) -prune -o -type f \
    -newer $1 -print 2>/dev/null | awk -F/ '{d=$2"/"$3"/"$4; if (NF<=4) d=$2"/"$3; n[d]++} END{for (k in n) print n[k], k}' \
    | sort -rn | head -25 | sed 's/^/  new: /'
  find / -xdev -newer $1 -name '*.best_config' 2>/dev/null | head -3 | sed 's/^/  best_config: /'
  find $cc/triton -newer $1 -type f 2>/dev/null | head -24 | sed 's/^/  new in the cache'"'"'s triton: /'
  ls -la ~/.nv/ComputeCache 2>/dev/null | head -3 | sed 's/^/  ComputeCache: /'; touch $1; }
touch /tmp/mark; sleep 1
for name in first second; do
  lim=$((budget - SECONDS)); [ $lim -gt 150 ] && lim=150; [ $lim -lt 80 ] && { echo "no time for $name"; break; }
  STACK_SAMPLE_OUT=$OUT/q/stack_$name PYTHONPATH=$A/s73/sampler runin2 $R $name $lim aotF "${SHORT[@]}" --compile-cache $cc
  echo "files written during $name:"; newfiles /tmp/mark
  head -25 $OUT/q/stack_$name.0 | cut -c1-160
done
