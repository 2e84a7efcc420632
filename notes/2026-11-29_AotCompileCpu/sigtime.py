import sys, time, os
sys.path.insert(0, os.environ.get("REPO", "."))
import torch, train_gpt as tg, compilation
dev = torch.device("cpu")
params = {k: v.detach().requires_grad_() for k, v in tg.init_params(tg.smoke_hyperparameters(param_dtype="float32"), dev, 7).items()}
hp = tg.smoke_hyperparameters(param_dtype="float32")
ids = torch.randint(0, 511, (256,), dtype=torch.int32); ids[0] = 511
fns = tg.build_fns(hp, dev, compile_model=False, attention="dense")
mb = tg.MicroBatch(ids, ids.long(), tg.prepare_ids(ids, hp.vocab_size), bigram=tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id), bigram_prep=None)
x = tg.model_inputs(hp, params, fns, mb, (1, 2), {})
args = (x.params, x.e, x.ves, x.big, x.ids, x.cu, mb.targets, x.tables, torch.ones(3), None)
print(len(torch.utils._pytree.tree_leaves(args)), "leaves")
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(1000):
        import hashlib
        hashlib.sha256(compilation.call_signature(args).encode()).hexdigest()
    print(f"{(time.perf_counter() - t0) * 1000:.1f} us per call")
def fast(args):
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    return tuple((tuple(x.shape), x.dtype, x.requires_grad, getattr(x, "_dynamo_dynamic_indices", None) is not None) if isinstance(x, torch.Tensor) else x for x in leaves)
d = {}
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(1000):
        k = fast(args); d.get(k)
    print(f"fast {(time.perf_counter() - t0) * 1000:.1f} us per call")
t0 = time.perf_counter()
for _ in range(1000):
    torch.utils._pytree.tree_flatten(args)
print(f"flatten only {(time.perf_counter() - t0) * 1000:.1f} us per call")
t0 = time.perf_counter()
for _ in range(1000):
    compilation.quick_signature(torch.utils._pytree.tree_leaves(args))  # the flatten included, as Precompiled pays it
print(f"quick_signature {(time.perf_counter() - t0) * 1000:.1f} us per call")
