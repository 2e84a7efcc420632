import sys, time, os
DIR = sys.argv[1]  # a folder probe.py pc filled
os.environ["TORCHINDUCTOR_CACHE_DIR"] = DIR + "/ind"
sys.path.insert(0, os.environ.get("REPO", "."))
import torch, train_gpt as tg, compilation, dataclasses
torch._dynamo.config.enable_aot_compile = True
hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511)
dev = torch.device("cpu")
params = {k: v.detach().requires_grad_() for k, v in tg.init_params(hp, dev, 7).items()}
g = torch.Generator().manual_seed(8)
ids = torch.randint(0, 511, (256,), generator=g, dtype=torch.int64).to(torch.int32); ids[0] = 511; ids[100] = 511
targets = torch.randint(0, 511, (256,), generator=g)
fns = tg.build_fns(hp, dev, compile_model=False, attention="dense")
mb = tg.MicroBatch(ids, targets, tg.prepare_ids(ids, hp.vocab_size), bigram=tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id), bigram_prep=tg.prepare_ids(tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id), hp.bigram_vocab_size))
fb = torch.compile(fns.train_step, fullgraph=True, dynamic=False)
pc = compilation.Precompiled(fns.train_step, "train_step", DIR + "/pc", fb)
cap = {}
def grab(*a):
    cap["a"] = a
    return pc(*a)
fns2 = dataclasses.replace(fns, train_step=grab)
tg.forward(hp, params, fns2, mb, (1, 2), {}, train=True, mtp=torch.tensor([1.0, 0.5, 0.25])).backward()
print(compilation.PRECOMPILED)
f = next(iter(pc.fns.values())); a = cap["a"]
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(1000): f.guard_check(*a)
    print(f"guard_check {(time.perf_counter() - t0) * 1000:.1f} us")
fb(*a); pc(*a)
import statistics
for rep in range(3):
    res = {}
    for name, fn in (("plain", fb), ("precompiled", pc), ("aot direct", f)):
        t0 = time.perf_counter()
        for _ in range(300): fn(*a)
        res[name] = (time.perf_counter() - t0) / 300 * 1e6
    print({k: round(v) for k, v in res.items()}, "us per forward call")
