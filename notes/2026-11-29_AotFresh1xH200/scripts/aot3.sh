#!/bin/bash
# Usage: bash .anchor/s74/aot3.sh BUDGET_S   (the device's tree: branch next = main + ccdir + gatesum)
# --compile-cache compiled into its own folder (branch ccdir), short schedule, world size 1, on one machine:
#   cold:   empty --compile-cache /tmp/cc, which it compiles into (its own inductor/Triton folders stay empty)
#   loaded: another process loading /tmp/cc with empty inductor/Triton caches of its own
# then packs /tmp/cc into $OUT/cc.tar.xz.partNN (15 MiB each) for probe_fresh.sh on a fresh machine (same path).
# Checks that the saved functions name no file outside /tmp/cc/inductor (the fix) and lists the .best_config count.
source .anchor/s72/common2.sh
budget=$1
job() { local name=$1 tag=$2 lim=$3; shift 3
  local left=$((budget - SECONDS)); [ $left -lt $lim ] && lim=$left
  [ $lim -lt 90 ] && { echo "no time for $name ($lim s)"; return 1; }
  runin2 $R $name $lim $tag "${SHORT[@]}" "$@"; }
job cold aot 300 --compile-cache /tmp/cc || exit 0
timeout 30 python3 records/launch_counts.py /tmp/cc/inductor --names 12 > $OUT/q/launch_counts_next.md 2>&1
sed -n 3,9p $OUT/q/launch_counts_next.md | cut -d'|' -f3-5
echo "best_config files in /tmp/cc/inductor: $(find /tmp/cc/inductor -name '*.best_config' | wc -l); in /tmp/ind_aot: $(find /tmp/ind_aot -name '*.best_config' 2>/dev/null | wc -l)"
python3 - <<'PY'
import glob, re
from pathlib import Path
inside = outside = 0
for f in glob.glob("/tmp/cc/aot/*/*.aot"):
    data = Path(f).read_bytes()
    for m in re.finditer(rb"/[0-9a-z]{2}/(c[0-9a-z]{51}\.py|[0-9a-f]{64}\.best_config)", data):
        ok = data[max(0, m.start() - 40):m.start()].endswith(b"/tmp/cc/inductor")
        inside += ok; outside += not ok
print(f"inductor files named by the .aot files: {inside} in /tmp/cc/inductor, {outside} elsewhere")
PY
python3 - <<'PY'
# the whole functions' signatures (.sig beside each .aot): where the compile-ahead processes' keys differ from the
# run's own, the lines that differ (the run never loads their files)
import difflib, glob, collections
by = collections.defaultdict(list)
for f in sorted(glob.glob("/tmp/cc/aot/*/*.sig")):
    by[f.rsplit("/", 1)[1].split("-")[0]].append(f)
for name, files in by.items():
    print(name, len(files), "signatures")
    texts = [open(f).read().splitlines() for f in files]
    for i in range(1, len(texts)):
        d = [l for l in difflib.unified_diff(texts[0], texts[i], lineterm="", n=0) if l[:1] in "+-" and l[:3] not in ("+++", "---")]
        print(f"  {files[0].rsplit('/', 1)[1]} vs {files[i].rsplit('/', 1)[1]}: {len(d)} lines differ", *[x[:160] for x in d[:8]], sep="\n    ")
PY
du -sh /tmp/cc/* 2>&1; cat /tmp/cc/stamp.json
XZ_OPT=-T0 tar -C /tmp/cc -cJf /tmp/cc.tar.xz . && split -b 15M -d /tmp/cc.tar.xz $OUT/cc.tar.xz.part && sha256sum /tmp/cc.tar.xz && ls -la $OUT
job loaded aotB 150 --compile-cache /tmp/cc || exit 0
