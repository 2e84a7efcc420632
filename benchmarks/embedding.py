"""Benchmark cases for kernels.embedding: the speedrun's embedding backward with uniform and Zipf ids, dense and
accumulate modes (the accumulate mode against the dense gradient followed by ``acc.add_``, what the trainer does
with --no-embed-grad-to-acc)."""
import torch

from kernels.embedding import (TUNING_CANDIDATES, embedding_backward, embedding_backward_accumulate,
                               embedding_backward_accumulate_ref, embedding_backward_ordered_ref, prepare_ids)


def _speedrun_ids(kind, n, num_embeddings, generator):
    """Uniform ids, or Zipf(1) ids with id = frequency rank (frequent tokens have small ids, as in GPT-2 BPE)."""
    if kind == "uniform":
        return torch.randint(0, num_embeddings, (n,), generator=generator)
    weights = 1.0 / torch.arange(1, num_embeddings + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


def _config_suffixes(tune):
    return [(None, "")] + ([(c, "[" + ",".join(f"{k}={v}" for k, v in c.items()) + "]")
                            for c in TUNING_CANDIDATES] if tune else [])


def _dense_cases(device, tune, gen, N, C, V):
    """embedding_backward: bf16 and fp32 (grad and output alike), uniform and Zipf ids; torch baselines."""
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

            for cfg, suffix in _config_suffixes(tune):
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


def _accumulate_cases(device, tune, gen, N, C, V, kinds, table):
    """embedding_backward_accumulate into an fp32 (V, C) accumulator, bf16 gradients (the trainer's), against
    the trainer's default: the dense bf16 gradient, then ``acc.add_`` of it. Bytes: the gradient, 8 per element
    of the U touched rows (read and write of acc), the prep; the baseline moves the gradient, the dense weight
    gradient three times (written, read by add_) and acc twice (read, write) over all V rows."""
    cases = []
    for kind in kinds:
        ids_cpu = _speedrun_ids(kind, N, V, gen)
        touched = int(ids_cpu.unique().numel())
        prep = prepare_ids(ids_cpu, V).to(device)
        ids = ids_cpu.to(device)
        g = (torch.randn(N, C, generator=gen) * 0.5 - 2.3).to(device=device, dtype=torch.bfloat16)
        acc = (torch.randn(V, C, generator=gen) * 0.5 - 2.3).to(device)
        acc_dense = acc.clone()
        nbytes = N * C * 2 + touched * C * 8 + 4 * N + 4 * (V + 1)

        def check(g=g, ids=ids, prep=prep, acc=acc, what=f"{table}, {kind}"):
            start = acc.clone()
            ref = embedding_backward_accumulate_ref(g, ids, start)
            dense = (start + embedding_backward(g, ids, V, prep=prep).float()).cpu()
            for cfg in [None] + TUNING_CANDIDATES:
                got = embedding_backward_accumulate(g, ids, start.clone(), prep=prep, config=cfg).cpu()
                if not torch.equal(got, ref) or not torch.equal(got, dense):
                    raise AssertionError(f"embedding_backward_accumulate ({what}, config {cfg}): "
                                         f"{int((got != ref).sum())} elements differ from the reference, "
                                         f"{int((got != dense).sum())} from acc + the dense gradient")

        for cfg, suffix in _config_suffixes(tune):
            cases.append(dict(
                op="embedding_backward_accumulate" + suffix,
                shape=f"{N}x{C}->{V}x{C} {kind} {table} ({touched} rows)", dtype="bf16->fp32",
                fn=lambda g=g, ids=ids, prep=prep, acc=acc, cfg=cfg:
                    embedding_backward_accumulate(g, ids, acc, prep=prep, config=cfg),
                bytes=nbytes, flops=0,
                baselines={} if cfg is not None else {
                    "dense+add_": lambda g=g, ids=ids, prep=prep, a=acc_dense: a.add_(
                        embedding_backward(g, ids, V, prep=prep))},
                check=check if cfg is None else None))
    return cases


def bench_cases(device, tune=False):
    """N=49152, C=768 with prep. Dense mode: V=50304, bf16 and fp32, uniform and Zipf ids. Accumulate mode
    (bf16 gradients into fp32): the token and value-embedding tables (V=50304, uniform and Zipf ids) and the
    bigram table (V=251520, uniform ids: hashes), each against dense + acc.add_.

    tune=True adds one case per TUNING_CANDIDATES entry (op name carries the config)."""
    N, C, V = 49152, 768, 50304
    gen = torch.Generator().manual_seed(0)
    cases = _dense_cases(device, tune, gen, N, C, V)
    cases += _accumulate_cases(device, tune, gen, N, C, V, ("uniform", "zipf"), "token")
    cases += _accumulate_cases(device, False, gen, N, C, 5 * V, ("uniform",), "bigram")
    return cases
