# Inductor C++ (CPU) kernel calls of fns.layers forward and backward, 6 layers, smoke sizes: python cpu_kernel_count.py REPO_ROOT
import sys, os, re, torch
root = sys.argv[1]; sys.path.insert(0, root); sys.path.insert(0, root + "/tests")
import train_gpt as tg, test_model as tm
from torch._inductor.utils import run_and_get_code
L = 6
hp = tg.smoke_hyperparameters(param_dtype="bfloat16", vocab_size=512, bos_id=511, num_layers=L,
                              ve_tables=(0,) + (-1,) * (L - 2) + (0,), one_stream=True, mudd=True,
                              xsa=True, backout_layer=0, num_heads=4, head_dim=16)
params = tg.init_params(hp, torch.device("cpu"), 0)
fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
T = 256
ids = torch.arange(T, dtype=torch.int32) % hp.bos_id; ids[[0, 100]] = hp.bos_id
layers = torch.compile(fns.layers, fullgraph=True, dynamic=False)
def go():
    x = layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), (1, 2), {}))
    x.float().sum().backward()
_, codes = run_and_get_code(go)
for c in codes:
    calls = re.findall(r"\n\s+(cpp_fused_\w+)\(", c)
    print(len(calls), "kernel calls;", len(re.findall(r"extern_kernels\.\w+\(", c)), "extern")
