import torch
from kernels.mlp import relu2_mlp
M = 256
g = torch.Generator(device="cuda").manual_seed(M)
x = torch.randn(M, 768, device="cuda", generator=g).bfloat16().requires_grad_()
w = (torch.randn(3072, 768, device="cuda", generator=g) * 0.03).bfloat16().requires_grad_()
w2 = (torch.randn(3072, 768, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
fn = torch.compile(relu2_mlp, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
fn(x, w, w2).sum().backward()
print("done")
