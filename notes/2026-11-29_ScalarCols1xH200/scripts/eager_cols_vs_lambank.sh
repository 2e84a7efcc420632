#!/bin/bash
# scalarcols (git archive scalarcols | tar -x -C /tmp/oldtree) against branch lambank (worktree /work/lb), eager on
# the CPU: ../../2026-11-29_ScalarTables1xH200/scripts/eager_old_vs_new.py pointed at /work/lb, written to
# /tmp/eager_cmp.py (lambda_grad_accuracy.py reads it), plus the lambdas' gradient differences. Run from /work/lb.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
sed 's#/work/main/tests#/work/lb/tests#; s#"/work/main")#"/work/lb")#' \
  "$here/../../2026-11-29_ScalarTables1xH200/scripts/eager_old_vs_new.py" > /tmp/eager_cmp.py
cat >> /tmp/eager_cmp.py <<'PY'
        if "scalars" in diff:
            a, b = go["scalars"], gn["scalars"]
            rel = ((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max().item()
            print("   scalars grad: max rel diff", f"{rel:.3g}", "differing entries", (a != b).nonzero().flatten().tolist())
PY
PYTHONPATH=. python /tmp/eager_cmp.py
