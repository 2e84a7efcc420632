"""CPU probe: can torch.compile(...).aot_compile carry our training step (forward + backward) to another process,
and how long does loading take against a warm inductor cache? Usage: probe.py MODE DIR  (MODE: eager, cold, warm,
aot_save, aot_load, pc: branch aotcache's Precompiled, which also times its function's guard check). Prints the first call's seconds (forward + backward) and a hash of loss + grads."""
import sys, time, os, hashlib, dataclasses
t_start = time.perf_counter()
mode, d = sys.argv[1], sys.argv[2]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = d + "/ind"
import torch
sys.path.insert(0, os.environ.get("REPO", "."))
import train_gpt as tg
torch._dynamo.config.enable_aot_compile = True  # torch 2.11 needs it; 2.13's default
extra = dict(one_stream=True, mudd=True, xsa=True, backout_layer=0, num_heads=4, head_dim=16) if os.environ.get("FEATURES") else {}
hp = tg.smoke_hyperparameters(param_dtype=os.environ.get("DTYPE", "float32"), vocab_size=512, bos_id=511, **extra)
dev = torch.device("cpu")
params = {k: v.detach().requires_grad_() for k, v in tg.init_params(hp, dev, 7).items()}
g = torch.Generator().manual_seed(8)
ids = torch.randint(0, 511, (256,), generator=g, dtype=torch.int64).to(torch.int32); ids[0] = 511; ids[100] = 511
targets = torch.randint(0, 511, (256,), generator=g)
fns = tg.build_fns(hp, dev, compile_model=False, attention="dense")
prep = tg.prepare_ids(ids, hp.vocab_size)
big = tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id)
mb = tg.MicroBatch(ids, targets, prep, bigram=big, bigram_prep=tg.prepare_ids(big, hp.bigram_vocab_size))
mtp = torch.tensor([1.0, 0.5, 0.25])
t_ready = time.perf_counter()
if mode in ("cold", "warm"):
    fns = dataclasses.replace(fns, train_step=torch.compile(fns.train_step, fullgraph=True, dynamic=False))
elif mode == "aot_save":
    orig = fns.train_step
    def capture(*a):
        global aot
        aot = torch.compile(orig, fullgraph=True, dynamic=False).aot_compile((a, {}))
        return aot(*a)
    fns = dataclasses.replace(fns, train_step=capture)
elif mode == "pc":
    import compilation
    fb = torch.compile(fns.train_step, fullgraph=True, dynamic=False)
    pre = compilation.Precompiled(fns.train_step, "train_step", d + "/pc", fb)
    def capture(*a):
        global step_args
        step_args = a
        return pre(*a)
    fns = dataclasses.replace(fns, train_step=capture)
elif mode == "aot_load":
    t0 = time.perf_counter()
    with open(d + "/aot.bin", "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    print(f"load_compiled_function {time.perf_counter() - t0:.2f} s")
    def unmarked(*a):
        for t in a:
            if isinstance(t, torch.Tensor):
                for attr in ("_dynamo_dynamic_indices", "_has_dynamo_dim_marking"):
                    if hasattr(t, attr):
                        print("arg", tuple(t.shape), attr, getattr(t, attr)) if os.environ.get("SHOW") else None
                        delattr(t, attr)
        return loaded(*a)
    fns = dataclasses.replace(fns, train_step=unmarked)
t0 = time.perf_counter()
loss = tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=mtp)
loss.backward()
t1 = time.perf_counter()
if mode == "aot_save":
    aot.save_compiled_function(d + "/aot.bin")
    print("saved", os.path.getsize(d + "/aot.bin"), "bytes")
h = hashlib.sha256(loss.detach().numpy().tobytes())
for k in sorted(params):
    if params[k].grad is not None:
        h.update(params[k].grad.float().numpy().tobytes())
if os.environ.get("SECOND"):  # another micro-batch with a different document count
    ids2 = ids.clone(); ids2[200] = 511; ids2[50] = 511
    mb2 = tg.MicroBatch(ids2, targets, tg.prepare_ids(ids2, hp.vocab_size), bigram=tg.bigram_hash(ids2, hp.bigram_vocab_size, hp.bos_id),
                        bigram_prep=tg.prepare_ids(tg.bigram_hash(ids2, hp.bigram_vocab_size, hp.bos_id), hp.bigram_vocab_size))
    t2 = time.perf_counter(); l2 = tg.forward(hp, params, fns, mb2, (1, 2), {}, train=True, mtp=mtp); l2.backward()
    print(f"second micro-batch (5 docs): {time.perf_counter() - t2:.2f} s, loss {l2.item():.6f}")
if mode == "pc":
    print(*(e[1] for e in compilation.PRECOMPILED), sep="\n")
    print(*compilation.compile_report(compilation.compile_metrics(), [])[0], sep="\n")
    f = next(iter(pre.fns.values()))
    t2 = time.perf_counter()
    for _ in range(1000):
        f.guard_check(*step_args)
    print(f"guard_check: {(time.perf_counter() - t2) * 1000:.1f} us per call")
print(f"{mode}: imports+setup {t_ready - t_start:.2f} s, first step {t1 - t0:.2f} s, loss {loss.item():.6f}, "
      f"hash {h.hexdigest()[:16]}")
