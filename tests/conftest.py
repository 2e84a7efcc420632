"""Test setup shared by every test module.

Without a GPU the Triton kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be in the
environment before any ``@triton.jit`` function is defined, i.e. before a ``kernels`` module is imported.
pytest imports this file before it collects the test modules, so setting it here is early enough.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_report_header(config):
    mode = f"GPU ({torch.cuda.get_device_name()})" if HAS_CUDA else "CPU, TRITON_INTERPRET=1"
    return f"kernels run on: {mode}; torch {torch.__version__}"


@pytest.fixture
def device():
    return DEVICE
