"""Where the tests run. The suite runs on the CPU in fp32 whatever the host has (tests/conftest.py
sets FEDTOPS_DEVICE=cpu). The tests marked ``gpu`` run numerics at bf16 and assert bounds derived
from bf16's precision (tests/precision.py): they run once per device of :data:`BF16_DEVICES`, on
CUDA where there is one and on the CPU in bf16 always, so CPU-only CI checks the same bounds."""

import pytest
import torch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
BF16_DEVICES = [pytest.param("cuda", marks=needs_cuda, id="cuda-bf16"), pytest.param("cpu", id="cpu-bf16")]


def on_bf16_devices(test):
    """Mark ``test`` gpu and run it once per device of :data:`BF16_DEVICES` (its ``device`` argument)."""
    return pytest.mark.gpu(pytest.mark.parametrize("device", BF16_DEVICES)(test))
