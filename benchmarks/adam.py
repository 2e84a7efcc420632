"""Benchmark cases for kernels.adam: the functional step and the FusedAdamW optimizer."""
import torch

from kernels.adam import DEFAULT_CONFIG, TUNING_CANDIDATES, FusedAdamW, fused_adamw_ref, fused_adamw_step


def _bench_inputs(sizes, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: 100M values per call
    params = [torch.randn(n, generator=gen, device=device).mul_(0.02).to(torch.bfloat16) for n in sizes]
    grads = [torch.randn(n, generator=gen, device=device).mul_(1e-3).to(torch.bfloat16) for n in sizes]
    ms = [torch.randn(n, generator=gen, device=device).mul_(1e-4) for n in sizes]
    vs = [torch.rand(n, generator=gen, device=device).mul_(1e-6) for n in sizes]
    ws = [p.float() for p in params]
    return params, grads, ms, vs, ws


def _bench_check(sizes, device, hp, cfg):
    """Untimed: one step on fresh inputs must equal fused_adamw_ref bitwise, with param = round(master)."""
    params, grads, ms, vs, ws = _bench_inputs(sizes, device, seed=1)
    refs = [fused_adamw_ref(w, g, m, v, **hp) for w, g, m, v in zip(ws, grads, ms, vs)]
    fused_adamw_step(params, grads, ms, vs, ws, config=cfg, **hp)
    for i, (p, w, m, v, (rw, rm, rv)) in enumerate(zip(params, ws, ms, vs, refs)):
        if not (torch.equal(w, rw) and torch.equal(m, rm) and torch.equal(v, rv) and torch.equal(p, rw.to(p.dtype))):
            raise AssertionError(f"fused_adamw_step differs from fused_adamw_ref on tensor {i} ({sizes[i]} elements)")


def bench_cases(device, tune=False):
    """24M bf16 params with fp32 masters: the functional step on one tensor, and FusedAdamW.step on a speedrun-like
    mix of big matrices and 64 small tensors (its time includes the optimizer's per-param Python work)."""
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, step=10)
    # embedding half-shard 768*50304/2, two MLP matrices 768*3072*2, one attention matrix 768*768, and 64 small
    # scalar / gate tensors of 1..768 elements: about 24.6M elements.
    mix = [768 * 50304 // 2, 768 * 3072 * 2, 768 * 768] + [1 + (37 * i) % 768 for i in range(64)]
    layouts = [("fused_adamw_step", "1x24M", [24 * 2 ** 20]), ("FusedAdamW", f"mix{len(mix)}", mix)]
    cases = []
    for op, label, sizes in layouts:
        params, grads, ms, vs, ws = _bench_inputs(sizes, device, seed=0)
        # grad bf16 read 2 + m, v, master read+write 3*8 + param bf16 write 2 (the param is not read)
        nbytes = 28 * sum(sizes)
        baselines = {}
        for name, flag in (("torch", "fused"), ("torch foreach", "foreach")):
            torch_params = [w.clone().requires_grad_() for w in ws]  # fp32 copies, fp32 grads
            for tp, g in zip(torch_params, grads):
                tp.grad = g.float()
            opt = torch.optim.AdamW(torch_params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                    weight_decay=hp["weight_decay"], **{flag: True})
            opt.step()  # allocate the state outside the timed calls
            baselines[name] = opt.step
        for cfg in TUNING_CANDIDATES if tune else [DEFAULT_CONFIG]:
            if op == "fused_adamw_step":
                def fn(cfg=cfg, params=params, grads=grads, ms=ms, vs=vs, ws=ws):
                    fused_adamw_step(params, grads, ms, vs, ws, config=cfg, **hp)
            else:
                opt_params = [p.clone().requires_grad_() for p in params]
                for p, g in zip(opt_params, grads):
                    p.grad = g
                ours = FusedAdamW(opt_params, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                  weight_decay=hp["weight_decay"])
                ours.config = cfg
                ours.step()
                fn = ours.step
            name = op if not tune else f"{op}[{cfg[0]},{cfg[1]}w]"
            cases.append(dict(op=name, shape=label, dtype="bf16+fp32 master", fn=fn, bytes=nbytes, flops=0,
                              baselines=baselines,
                              check=lambda sizes=sizes, cfg=cfg: _bench_check(sizes, device, hp, cfg)))
    return cases
