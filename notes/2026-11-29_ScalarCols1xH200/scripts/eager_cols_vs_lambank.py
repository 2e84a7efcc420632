# scalarcols (git archive scalarcols | tar -x -C /tmp/oldtree) against branch lambank (worktree /work/lb), eager on the CPU:
# outputs and every gradient bitwise equal? Run from the repository root with PYTHONPATH=.
import sys, importlib, dataclasses, torch
sys.path.insert(0, "/work/lb/tests"); sys.path.insert(0, "/work/lb")
import train_gpt as new
import test_model as tm
spec = importlib.util.spec_from_file_location("old_tg", "/tmp/oldtree/train_gpt.py")
old = importlib.util.module_from_spec(spec); sys.path.insert(0, "/tmp/oldtree"); spec.loader.exec_module(old)
def run(mod, hp, params, ids):
    fns = mod.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
    P = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    x = fns.layers(*mod.model_inputs(hp, P, fns, mod.MicroBatch(ids), (1, 2), {}))
    loss = (x.float() ** 2).mean()
    loss.backward()
    return x, {k: v.grad for k, v in P.items()}
configs = {
 "default": dict(),
 "rec74": dict(xsa=False, one_stream=False, mudd=False),
 "one_nomudd": dict(mudd=False),
 "nobits": dict(mudd=False, bigram=False, smear=False, attn_lambdas=False, backout=False),
}
for name, ov in configs.items():
    for dt in ("bfloat16", "float32"):
        base = dict(param_dtype=dt, vocab_size=512, bos_id=511, num_layers=6, ve_tables=(0, 1, -1, -1, 0, 1), no_attn_layers=(2,), paired_head_layers=(0,), xsa=True, one_stream=True, mudd=True, parallel_start=4, skip_from=1, skip_to=3, backout_layer=3, long_window_layers=(1, 5))
        base.update(ov)
        hp = new.smoke_hyperparameters(**base)
        params = tm.perturbed(hp, seed=3)
        params = {k: v.detach().to(getattr(torch, dt) if v.dtype != torch.float32 or new.PARAMS[k].matrix else torch.float32) for k, v in params.items()}
        ids = tm._ids(hp, 384, seed=4)
        xo, go = run(old, hp, params, ids); xn, gn = run(new, hp, params, ids)
        same = torch.equal(xo, xn) and all((go[k] is None and gn[k] is None) or torch.equal(go[k], gn[k]) for k in go)
        diff = [k for k in go if not ((go[k] is None and gn[k] is None) or torch.equal(go[k], gn[k]))]
        print(name, dt, "bitwise" if same else f"DIFF {diff}")
        if "scalars" in diff:
            a, b = go["scalars"], gn["scalars"]
            rel = ((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max().item()
            print("   scalars grad: max rel diff", f"{rel:.3g}", "differing entries", (a != b).nonzero().flatten().tolist())
