"""The kernel tests' fixtures: `path` (each test through the Triton kernels and through the torch twins) and `twin`
(the ops' CPU kernels). kernel_checks sets TRITON_INTERPRET before anything imports triton."""

import zlib

import pytest
import torch
from kernel_checks import path, twin  # noqa: F401


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws its inputs from its own seed (its name's CRC), so a failure repeats when the test runs alone
    or in any order, whatever ran before it in the process."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
