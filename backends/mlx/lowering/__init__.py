"""Handlers that lower each op of an exported graph to our IR (registry.py),
and the builder they write with."""

from .. import custom_kernel_ops  # noqa: F401  (registers torch.ops.mlx.*, which handlers match)
