"""Benchmark cases for kernels.embedding: the speedrun's embedding backward with uniform and Zipf ids."""
import torch

from kernels.embedding import TUNING_CANDIDATES, embedding_backward, embedding_backward_ordered_ref, prepare_ids


def _speedrun_ids(kind, n, num_embeddings, generator):
    """Uniform ids, or Zipf(1) ids with id = frequency rank (frequent tokens have small ids, as in GPT-2 BPE)."""
    if kind == "uniform":
        return torch.randint(0, num_embeddings, (n,), generator=generator)
    weights = 1.0 / torch.arange(1, num_embeddings + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


def bench_cases(device, tune=False):
    """N=49152, C=768, V=50304 with prep; uniform and Zipf ids; bf16 and fp32 (grad and output alike).

    tune=True adds one case per TUNING_CANDIDATES entry (op name carries the config)."""
    N, C, V = 49152, 768, 50304
    gen = torch.Generator().manual_seed(0)
    configs = [(None, "")] + ([(c, "[" + ",".join(f"{k}={v}" for k, v in c.items()) + "]")
                               for c in TUNING_CANDIDATES] if tune else [])
    cases = []
    for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for kind in ("uniform", "zipf"):
            ids_cpu = _speedrun_ids(kind, N, V, gen)
            prep = prepare_ids(ids_cpu, V).to(device)
            ids = ids_cpu.to(device)
            g = (torch.randn(N, C, generator=gen) * 0.5 - 2.3).to(device=device, dtype=dtype)
            es = g.element_size()
            nbytes = N * C * es + V * C * es + 4 * N + 4 * (V + 1)    # grad + weight grad + order + row_ptr
            compiled = torch.compile(lambda g, ids: torch.zeros(V, C, dtype=g.dtype, device=g.device)
                                     .index_add_(0, ids, g))

            def check(g=g, ids=ids, prep=prep, dtype=dtype):
                ref = embedding_backward_ordered_ref(g, ids, V).to(dtype)
                got = embedding_backward(g, ids, V, prep=prep).cpu()
                if not torch.equal(got, ref):
                    bad = int((got != ref).sum())
                    raise AssertionError(f"embedding_backward: {bad} elements differ from the ordered reference")
                for cfg in TUNING_CANDIDATES:
                    if not torch.equal(embedding_backward(g, ids, V, prep=prep, config=cfg).cpu(), ref):
                        raise AssertionError(f"embedding_backward with config {cfg} changed the bits")

            for cfg, suffix in configs:
                cases.append(dict(
                    op="embedding_backward" + suffix, shape=f"{N}x{C}->{V}x{C} {kind}", dtype=dname,
                    fn=(lambda g=g, ids=ids, prep=prep, cfg=cfg:
                        embedding_backward(g, ids, V, prep=prep, config=cfg)),
                    bytes=nbytes, flops=0,
                    baselines={} if cfg is not None else {
                        "torch": lambda g=g, ids=ids: torch.ops.aten.embedding_dense_backward(g, ids, V, -1, False),
                        "torch.compile": lambda g=g, ids=ids, f=compiled: f(g, ids)},
                    check=check if cfg is None else None))
    return cases
