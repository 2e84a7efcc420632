# Bits of the traced fused MLP: compiled (C++ wrapper / Python wrapper) vs eager, repeated calls.
import torch, torch._dynamo
from kernels.mlp import relu2_mlp
torch.use_deterministic_algorithms(True, warn_only=True)
def run(fn, x, w, w2, dy):
    x = x.detach().requires_grad_(); w = w.detach().requires_grad_(); w2 = w2.detach().requires_grad_()
    y = fn(x, w, w2); y.backward(dy)
    return [t.clone() for t in (y, x.grad, w.grad, w2.grad)]
for M in (128, 256, 1024, 16384):
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 768, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3072, 768, device="cuda", generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(3072, 768, device="cuda", generator=g) * 0.02).bfloat16()
    dy = torch.randn(M, 768, device="cuda", generator=g).bfloat16()
    ref = run(relu2_mlp, x, w, w2, dy)
    for cpp in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(relu2_mlp, fullgraph=True, dynamic=False, options={"cpp_wrapper": cpp})
        outs = [run(fn, x, w, w2, dy) for _ in range(10)]
        same_rep = all(all(torch.equal(a, b) for a, b in zip(o, outs[0])) for o in outs)
        vs_eager = [torch.equal(a, b) for a, b in zip(outs[0], ref)]
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(outs[0], ref)]
        print(f"M={M} cpp_wrapper={cpp}: repeat-identical {same_rep}; equal to eager (y,dx,dw,dw2) {vs_eager} maxdiff {diffs}", flush=True)
