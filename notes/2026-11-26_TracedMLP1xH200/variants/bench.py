import importlib, sys, torch, triton
sys.path.insert(0, ".bench/variants")
M = 16384
x = torch.randn(M, 768, device="cuda").bfloat16(); w = (torch.randn(3072, 768, device="cuda") * .03).bfloat16()
g = torch.randn(M, 768, device="cuda").bfloat16(); w2 = (torch.randn(3072, 768, device="cuda") * .02).bfloat16()
for v in sys.argv[1:]:
    m = importlib.import_module("mlp_" + v)
    pre, act = m.linear_relu2(x, w)
    f = triton.testing.do_bench(lambda: m.linear_relu2(x, w), warmup=50, rep=300)
    b = triton.testing.do_bench(lambda: m.linear_relu2_bwd(g, w2, pre), warmup=50, rep=300)
    fl = 2 * M * 3072 * 768
    print(f"{v}: fwd {f*1e3:.1f} us ({fl/f/1e9:.0f} TFLOP/s)  bwd {b*1e3:.1f} us ({fl/b/1e9:.0f} TFLOP/s)", flush=True)
