"""What export writes: an LLM's caches, layer kinds, quantized weights and
sampler head, traced and lowered (hf_export.py)."""

from ... import custom_kernel_ops  # noqa: F401  (registers torch.ops.mlx.*, which the modules here call)
