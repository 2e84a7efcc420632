"""Benchmark cases for kernels.normuon: the world-size-1 Muon shards, against the eager reference
(``normuon_update_ref``)."""
import torch

from kernels.normuon import TUNING_CANDIDATES, normuon_update, normuon_update_ref


def _case(shape, device, config=None, suffix=""):
    k, M, N = shape
    gen = torch.Generator().manual_seed(0)
    o = (torch.randn(shape, generator=gen) / max(M, N) ** 0.5).to(device, torch.bfloat16)
    v2_shape = (k, M, 1) if M >= N else (k, 1, N)
    v2 = (torch.rand(v2_shape, generator=gen) / max(M, N)).to(device)
    master = (0.02 * torch.randn(shape, generator=gen)).to(device)
    lr_mul = torch.where(torch.arange(k) % 2 == 1, 2.0, 1.0).float().to(device)
    param = torch.empty(shape, dtype=torch.bfloat16, device=device)
    hp = dict(lr=0.03, beta2=0.95, wd=1.2 * 0.023)
    v2_t, master_t = v2.clone(), master.clone()
    numel = o.numel()
    # o read twice (pass 1 and pass 2, bf16), master read + written (fp32), param written (bf16); v2 and the
    # partials are < 0.1% of it.
    nbytes = 14 * numel

    def check():
        v_a, w_a, v_b, w_b = v2.clone(), master.clone(), v2.clone(), master.clone()
        normuon_update_ref(o, v_a, w_a, lr_mul, **hp)
        normuon_update(o, v_b, w_b, lr_mul, param, config=config, **hp)
        for name, got, want in (("v2", v_b, v_a), ("master", w_b, w_a)):
            err = (got - want).abs().max().item()
            bound = 8 * 2.0 ** -24 * want.abs().max().item()   # a few fp32 ulps: another summation order
            if not err <= bound:
                raise AssertionError(f"normuon_update{suffix} {shape}: {name} max error {err:.3e} > {bound:.3e}")

    return dict(op="normuon_update" + suffix, shape="x".join(map(str, shape)), dtype="bf16 o, fp32 master",
                fn=lambda: normuon_update(o, v2, master, lr_mul, param, config=config, **hp), bytes=nbytes, flops=0,
                baselines={"torch eager": lambda: normuon_update_ref(o, v2_t, master_t, lr_mul, **hp)},
                check=check)


def bench_cases(device, tune=False):
    """World-size-1 shards: attn_bank (40, 768, 768) and mlp_bank (22, 3072, 768)."""
    cases = [_case((40, 768, 768), device), _case((22, 3072, 768), device)]
    if tune:
        for cfg in TUNING_CANDIDATES:
            cases.append(_case((22, 3072, 768), device, config=cfg, suffix="[" + ",".join(map(str, cfg)) + "]"))
    return cases
