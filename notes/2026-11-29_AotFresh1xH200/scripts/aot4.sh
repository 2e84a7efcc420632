#!/bin/bash
# Usage: bash .anchor/s74/aot4.sh BUDGET_S   (the device's tree: branch next = main + cclink + gatesum)
# --compile-cache compiled into its own folder through its link (branch cclink), short schedule, world size 1:
#   cold:   empty --compile-cache /tmp/cc, which it compiles into through TMPDIR/train_gpt_compile_cache_ID
#   checks: every inductor file the saved functions name is under the link; the .sig diffs of the run's and the
#           compile-ahead processes' whole functions; packs /tmp/cc into $OUT/cc.tar.xz.partNN (15 MiB each)
#   moved:  /tmp/cc renamed /tmp/cc_moved (the filling path gone, as on another machine), loaded from there with
#           empty inductor/Triton caches of its own: it must not recreate /tmp/cc (nothing looked up by that path)
source .anchor/s72/common2.sh
budget=$1
job() { local name=$1 tag=$2 lim=$3; shift 3
  local left=$((budget - SECONDS)); [ $left -lt $lim ] && lim=$left
  [ $lim -lt 90 ] && { echo "no time for $name ($lim s)"; return 1; }
  runin2 $R $name $lim $tag "${SHORT[@]}" "$@"; }
job cold aot 300 --compile-cache /tmp/cc || exit 0
link=$(python3 -c "import tempfile; print(tempfile.gettempdir())")/train_gpt_compile_cache_$(cat /tmp/cc/id)
ls -la $link; cat /tmp/cc/stamp.json
timeout 30 python3 records/launch_counts.py /tmp/cc/inductor --names 12 > $OUT/q/launch_counts_next.md 2>&1
sed -n 3,9p $OUT/q/launch_counts_next.md | cut -d'|' -f3-5
echo "best_config files in /tmp/cc/inductor: $(find /tmp/cc/inductor -name '*.best_config' | wc -l); in /tmp/ind_aot: $(find /tmp/ind_aot -name '*.best_config' 2>/dev/null | wc -l)"
LINK=$link python3 - <<'PY'
import glob, os, re
from pathlib import Path
prefix = (os.environ["LINK"] + "/inductor").encode()
inside = outside = 0
for f in glob.glob("/tmp/cc/aot/*/*.aot"):
    data = Path(f).read_bytes()
    for m in re.finditer(rb"/[0-9a-z]{2}/(c[0-9a-z]{51}\.py|[0-9a-f]{64}\.best_config)", data):
        ok = data[max(0, m.start() - len(prefix) - 4):m.start()].endswith(prefix)
        inside += ok; outside += not ok
print(f"inductor files named by the .aot files: {inside} under the link, {outside} elsewhere")
PY
python3 - <<'PY'
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
du -sh /tmp/cc/* 2>&1
XZ_OPT=-T0 tar -C /tmp/cc -cJf /tmp/cc.tar.xz . && split -b 15M -d /tmp/cc.tar.xz $OUT/cc.tar.xz.part && sha256sum /tmp/cc.tar.xz && ls -la $OUT
mv /tmp/cc /tmp/cc_moved
job moved aotB 150 --compile-cache /tmp/cc_moved || exit 0
ls -la $link; [ -e /tmp/cc ] && { echo "/tmp/cc was recreated:"; find /tmp/cc -type f | head; } || echo "/tmp/cc not recreated"
