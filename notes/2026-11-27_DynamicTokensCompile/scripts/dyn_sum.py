"""python3 dyn_sum.py LOG...: per train_gpt.py log, the compile lines and the per-stage median ms/step."""
import json, re, statistics, sys

for path in sys.argv[1:]:
    text = open(path, errors="replace").read()
    body = text.split("=" * 100)[-1]  # after the source and the header
    hp = json.loads(re.search(r"^hyperparameters: (.*)$", text, re.M)[1])
    total = hp["scheduled_steps"] + hp["extension_steps"]
    ends = [total if s["end_frac"] is None else round(s["end_frac"] * hp["scheduled_steps"]) for s in hp["stages"]]
    steps = {int(m[1]): int(m[2]) for m in re.finditer(r"^step:(\d+)/\d+ train_time:(\d+)ms", body, re.M)}
    ms = {k - 1: steps[k] - steps[k - 1] for k in steps if k - 1 in steps}  # step index -> ms
    med = []
    for i, end in enumerate(ends):
        v = [t for s, t in ms.items() if (ends[i - 1] if i else 0) <= s < end]
        med.append(f"stage{i} {statistics.median(v):.1f} (n={len(v)})" if v else f"stage{i} -")
    print(f"== {path}  dynamic_tokens={hp.get('dynamic_tokens')}  world_size="
          f"{re.search(r'^world_size: (.*)$', text, re.M)[1]}  {re.search(r'^gpu: (.*)$', text, re.M)[1]}")
    for key in ("compile_options", "compile_phase", "compile_warmup_s", "compile_cache", "compile_report",
                "recompiles_during_timed_run", "stage_step_avg"):
        for line in re.findall(rf"^{key}:.*$", body, re.M):
            print("  " + line)
    vals = re.findall(r"^step:(\d+)/\d+ val_loss:(\S+)", body, re.M)
    print(f"  median ms/step: {', '.join(med)}; last val_loss {vals[-1] if vals else '-'}")
