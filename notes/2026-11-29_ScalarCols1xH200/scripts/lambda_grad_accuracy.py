# The lambda gradients of scalarcols (old) and lambank (new) in bf16 against float64 sums; reads /tmp/eager_cmp.py (written by eager_cols_vs_lambank.sh)
exec(open('/tmp/eager_cmp.py').read().split("configs = {")[0])
base = dict(vocab_size=512, bos_id=511, num_layers=6, ve_tables=(0, 1, -1, -1, 0, 1), no_attn_layers=(2,), paired_head_layers=(0,), xsa=True, one_stream=True, mudd=True, parallel_start=4, skip_from=1, skip_to=3, backout_layer=3, long_window_layers=(1, 5))
hp = new.smoke_hyperparameters(param_dtype="bfloat16", **base)
params = tm.perturbed(hp, seed=3)
params = {k: v.detach().to(torch.bfloat16 if new.PARAMS[k].matrix else torch.float32) for k, v in params.items()}
ids = tm._ids(hp, 384, seed=4)
xo, go = run(old, hp, params, ids); xn, gn = run(new, hp, params, ids)
# reference: the bf16 lanes' values are not reproducible in float64, so take the lambda gradient as
# sum(dW_eff * W) from the new run's own bank gradient: d lam = sum(dbank * bank) / lam for each matrix group
n = 2 * len(hp.attn_layers)
lam = params["scalars"][:n].to(torch.bfloat16).double().view(-1, 2)
bank = params["attn_bank"].double().view(-1, 4, *params["attn_bank"].shape[1:])
db = gn["attn_bank"].double().view_as(bank)
# dbank = lam * dW_eff  =>  dW_eff = dbank / lam; dlam0 = sum(dW_eff[:3] * W[:3]); dlam1 = sum(dW_eff[3] * W[3])
ref = torch.stack([(db[:, :3] * bank[:, :3]).sum((1, 2, 3)) / lam[:, 0], (db[:, 3] * bank[:, 3]).sum((1, 2)) / lam[:, 1]], 1).flatten()
for nm, g in (("old", go), ("new", gn)):
    e = ((g["scalars"][:n].double() - ref).abs() / ref.abs()).max().item()
    print(nm, "max rel err of the lambda gradients against float64 sums (from the bf16 bank gradient):", f"{e:.3g}")
