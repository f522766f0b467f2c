"""The kernel tests' fixtures: `path` (each test through the Triton kernels and through the torch twins) and `twin`
(the ops' CPU kernels). kernel_checks sets TRITON_INTERPRET before anything imports triton."""

from kernel_checks import path, twin  # noqa: F401
