import importlib, sys, torch
sys.path.insert(0, ".bench/variants")
for v in sys.argv[1:]:
    m = importlib.import_module("mlp_" + v)
    torch.manual_seed(0)
    x = torch.randn(70, 48, dtype=torch.float64); w = torch.randn(96, 48, dtype=torch.float64); w2 = torch.randn(96, 48, dtype=torch.float64)
    pre, act = m.linear_relu2(x.float(), w.float())
    r = m.linear_relu2_ref(x, w)
    g = torch.randn(70, 48, dtype=torch.float64)
    d = m.linear_relu2_bwd(g.float(), w2.float(), pre)
    dr = m.linear_relu2_bwd_ref(g, w2, pre.double())
    print(v, (pre - r[0]).abs().max().item(), (act - r[1]).abs().max().item(), (d - dr).abs().max().item())
