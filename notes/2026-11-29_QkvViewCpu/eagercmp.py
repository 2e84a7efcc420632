import sys, hashlib, torch
sys.path.insert(0, sys.argv[1])
import train_gpt as tg
out = hashlib.sha256()
for dtype in ("float32", "bfloat16"):
    for over in ({}, dict(one_stream=True, mudd=True, xsa=True, backout_layer=0, num_heads=4, head_dim=16), dict(attn_lambdas=False)):
        hp = tg.smoke_hyperparameters(param_dtype=dtype, vocab_size=512, bos_id=511, **over)
        params = {k: v.detach().requires_grad_() for k, v in tg.init_params(hp, torch.device("cpu"), 3).items()}
        fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
        ids = torch.arange(256, dtype=torch.int32) * 7 % hp.bos_id; ids[[0, 90]] = hp.bos_id
        x = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), (1, 2), {}))
        (x.float().square().mean()).backward()
        out.update(x.detach().float().numpy().tobytes())
        for k in sorted(params):
            if params[k].grad is not None:
                out.update(params[k].grad.float().numpy().tobytes())
print(out.hexdigest()[:16])
