"""Hand-written Triton kernels for the speedrun, one module per kernel family.

- ``kernels.transpose``: ``transpose_copy`` / ``transpose_add`` (tied embedding <-> transposed LM head).
- ``kernels.polar_express``: Gram products and Polar Express orthogonalization (Muon).
- ``kernels.momentum``: fused Nesterov momentum + Frobenius normalization feeding Polar Express.
- ``kernels.embedding``: deterministic embedding backward (a dense gradient, or added into an fp32 accumulator)
  and an autograd-aware lookup.
- ``kernels.adam``: fused AdamW with fp32 master weights.
- ``kernels.accumulate``: ``accumulate_``, a gradient added into its fp32 accumulator (acc += fp32(grad)).
- ``kernels.attention``: document attention, a custom op around torch's FlashAttention (varlen) kernels (no
  Triton kernel of ours), and its dense reference.
- ``kernels.mlp``: the MLP's up-projection with ReLU² in the matmul's epilogue (forward and backward).
- ``kernels.cross_entropy``: fused soft-capped multi-token cross entropy (LM-head loss) and its backward.
- ``kernels.dispatch``: ``StepKernels``, the optimizer's kernels by device (ours on CUDA, their references on the
  CPU).
- ``kernels.hardware``: measured GPU ceilings (bandwidth, bf16 matmul) and ``git_sha()``, shared by ``run_log.py``
  (the log's header and MFU line) and the benchmark driver (its roofline and CSV); ``keep_freed_memory()`` for the
  trainer's CPU runs; ``sm_count()`` for the persistent launchers.
- ``kernels._checks``: input checks shared by the launchers.

The benchmark driver and its cases live in the ``benchmarks`` package (``python -m benchmarks``), which imports
this one, never the reverse. Importing this package does no work: each module is imported on its own.
"""
