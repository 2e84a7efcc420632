"""The optimizer's kernels by device (``StepKernels.on``): our Triton launchers on CUDA, their PyTorch references
on the CPU (tests/test_<kernel>.py checks each launcher against its reference). train_gpt.py's Optimizer calls
them through the fields, whose comments give each one's contract.
"""
from typing import NamedTuple

from kernels.accumulate import accumulate_, accumulate_ref
from kernels.adam import fused_adamw_multi_step, fused_adamw_multi_step_ref
from kernels.momentum import nesterov_momentum, nesterov_momentum_ref
from kernels.normuon import normuon_update, normuon_update_ref
from kernels.polar_express import polar_express, polar_express_ref
from kernels.transpose import transpose_add, transpose_add_ref, transpose_copy, transpose_copy_ref


class StepKernels(NamedTuple):
    """The optimizer's kernels: ours on CUDA, their PyTorch references on the CPU (tests/test_<kernel>.py)."""
    momentum: object  # nesterov_momentum(grad, buf, momentum) -> X bf16
    polar: object  # polar_express(X, normalized=True)
    normuon: object  # normuon_update(o, v2, master, lr_mul, param_out, lr=, beta2=, wd=)
    adam: object  # fused_adamw_multi_step(params, grads, exp_avgs, exp_avg_sqs, masters, hparams)
    transpose_add: object  # dst += src.T
    transpose_copy: object  # dst = src.T
    accumulate: object  # acc += fp32(grad), in place

    @staticmethod
    def on(device):
        if device.type == "cuda":
            return StepKernels(nesterov_momentum, polar_express, normuon_update, fused_adamw_multi_step,
                               transpose_add, transpose_copy, accumulate_)

        def normuon_cpu(o, v2, master, lr_mul, param_out, **kw):  # the kernel's contract: param_out in place
            param_out.copy_(normuon_update_ref(o, v2, master, lr_mul, param_dtype=param_out.dtype, **kw))
        return StepKernels(nesterov_momentum_ref, polar_express_ref, normuon_cpu, fused_adamw_multi_step_ref,
                           transpose_add_ref, transpose_copy_ref, accumulate_ref)
