"""A bank without multipliers (the MLP's): unbind (A) against select views (B); inductor's CPU backward kernels."""
import sys, os, re, glob, shutil
variant = sys.argv[1]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"./out/ind2_{variant}"
shutil.rmtree(f"./out/ind2_{variant}", ignore_errors=True)
import torch
L, C, T = 11, 64, 128
torch.manual_seed(0)
bank = (torch.randn(2 * L, 4 * C, C) / C).requires_grad_()
x0 = torch.randn(T, C)

def f(bank, x):
    w = bank.unbind(0) if variant == "A" else [bank[i] for i in range(2 * L)]
    for i in range(L):
        x = x + torch.relu(x @ w[2 * i].T).square() @ w[2 * i + 1]
    return x.square().mean()

fc = torch.compile(f, fullgraph=True)
fc(bank, x0).backward()
torch.save(bank.grad, f"./out/g2_{variant}.pt")
for p in sorted(glob.glob(f"./out/ind2_{variant}/**/*.py", recursive=True), key=os.path.getmtime):
    s = open(p).read()
    if "def call(" not in s:
        continue
    kernels = re.findall(r"^\s+(cpp_fused_\w+)\(", s, re.M)
    print(variant, "kernels", len(kernels), "mm", len(re.findall(r"extern_kernels\.(mm|addmm|bmm)\(", s)),
          sorted(set(kernels))[:8])
