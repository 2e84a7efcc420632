"""Toy of the attention bank's gradient assembly: unbind + cat per layer (A) against per-layer views (B).
Prints the number of C++ kernels and the cat/stack-like ops in inductor's backward code (CPU)."""
import sys, os, re, glob, shutil
variant = sys.argv[1]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"./out/ind_{variant}"
shutil.rmtree(f"./out/ind_{variant}", ignore_errors=True)
import torch
A, C, T = int(os.environ.get("A", 6)), 64, 128
torch.manual_seed(0)
bank = (torch.randn(4 * A, C, C) / C).requires_grad_()
lam = torch.randn(A, 2, requires_grad=True)
x0 = torch.randn(T, C)

def f(bank, lam, x):
    mul = torch.cat([lam[:, :1, None, None].expand(A, 3, 1, 1), lam[:, 1:, None, None]], 1).view(4 * A, 1, 1)
    wb = mul * bank
    if variant == "A":
        w = wb.unbind(0)
        for a in range(A):
            w_qkv = torch.cat([w[4 * a], w[4 * a + 1], w[4 * a + 2]])
            q, k, v = (x @ w_qkv.T).view(T, 3, C).unbind(1)
            x = x + torch.relu(q * k + v) @ w[4 * a + 3].T
    else:
        for a in range(A):
            w_qkv = wb[4 * a:4 * a + 3].view(3 * C, C)
            q, k, v = (x @ w_qkv.T).view(T, 3, C).unbind(1)
            x = x + torch.relu(q * k + v) @ wb[4 * a + 3].T
    return x.square().mean()

fc = torch.compile(f, fullgraph=True)
loss = fc(bank, lam, x0)
loss.backward()
gb, gl = bank.grad.clone(), lam.grad.clone()
bank.grad = lam.grad = None
f(bank, lam, x0).backward()
print(variant, "max diff bank grad", (gb - bank.grad).abs().max().item(), "lam", (gl - lam.grad).abs().max().item())
codes = sorted(glob.glob(f"./out/ind_{variant}/**/*.py", recursive=True), key=os.path.getmtime)
for p in codes:
    s = open(p).read()
    if "def call(" not in s:
        continue
    kernels = re.findall(r"^\s+(cpp_fused_\w+)\(", s, re.M)
    mms = len(re.findall(r"extern_kernels\.(mm|addmm|bmm)\(", s))
    print(os.path.basename(p)[:12], "kernels", len(kernels), "mm", mms, "| with cat/stack/slice:",
          [k for k in kernels if re.search("cat|stack|slice|select", k)][:12])
torch.save((gb, gl), f"./out/grads_{variant}.pt")
