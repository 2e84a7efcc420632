# Does a backward graph with inductor-generated kernels compile and match under options={"cpp_wrapper": True}?
import torch
def f(x, w):
    return (torch.sin(x @ w) * x.cos().sum(1, keepdim=True)).square().sum()
for opts in ({"cpp_wrapper": True}, {"cpp_wrapper": False}):
    torch._dynamo.reset()
    x = torch.randn(512, 256, device="cuda", requires_grad=True); w = torch.randn(256, 256, device="cuda", requires_grad=True)
    g = torch.autograd.grad(torch.compile(f, options=opts)(x, w), (x, w))
    r = torch.autograd.grad(f(x, w), (x, w))
    print(opts, [(a - b).abs().max().item() for a, b in zip(g, r)], flush=True)
