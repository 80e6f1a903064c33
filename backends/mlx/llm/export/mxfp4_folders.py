"""Hugging Face folders whose experts ship in MXFP4 (gpt-oss), exported as they are.

Such a folder's config.json has `"quantization_config": {"quant_method":
"mxfp4", ...}` and each experts projection `P` is two tensors instead of a
weight: `P_blocks` (uint8 [E, N, K / 32, 16], two 4-bit E2M1 values a byte,
the even one in the low nibble) and `P_scales` (uint8 [E, N, K / 32], E8M0
exponents biased by 127), N being the projection's outputs. Those are MLX's
mxfp4 layout byte for byte (custom_kernel_ops/quantized.py: the packed
words are the bytes read as little-endian uint32), so export keeps them:
the experts run `mlx::gather_quantized_linear` in mode mxfp4 and the .pte
holds the folder's bytes. Every other tensor (attention, router, the
projections' biases) loads as in a plain folder, one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...custom_kernel_ops.quantized import QuantFormat
from .experts import is_experts_module, projections
from .mlx_folders import check_none_missing, meta_model, read_other_tensors, tensor_files, tensor_reader
from .quantize import QuantizedExperts

MXFP4 = QuantFormat(4, 32, "mxfp4")


def is_mxfp4_folder(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def load_mxfp4_folder(model_dir: str | Path, dtype: torch.dtype):
    """The model of the folder, its experts' projections as QuantizedExperts
    holding the folder's blocks and scales."""
    model_dir = Path(model_dir)
    _, model = meta_model(model_dir, dtype)
    files = tensor_files(model_dir)
    read = tensor_reader(model_dir, files)
    taken, holders = set(), {}
    for name in sorted(k[: -len("_blocks")] for k in files if k.endswith("_blocks")):
        module_name, _, proj = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not is_experts_module(module) or proj not in projections(module) or f"{name}_scales" not in files:
            raise ValueError(f"{model_dir}: {name}_blocks is not an experts projection with its _scales")
        param = getattr(module, proj)  # [E, K, N] (transposed) or [E, N, K], on meta
        experts, n, k = (param.shape[0], param.shape[2], param.shape[1]) if module.is_transposed else param.shape
        blocks, scales = read(f"{name}_blocks"), read(f"{name}_scales")
        if tuple(blocks.shape) != (experts, n, k // 32, 16) or tuple(scales.shape) != (experts, n, k // 32) or \
                blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or k % 32:
            kind = lambda t: f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"  # noqa: E731
            raise ValueError(f"{model_dir}: {name}_blocks {kind(blocks)} and _scales {kind(scales)} are not MXFP4 "
                             f"of a [{experts}, {n}, {k}] projection")
        packed = blocks.reshape(experts, n, k // 2).view(torch.int32)  # the bytes as MLX's words
        setattr(module, f"{proj}_quantized", QuantizedExperts(None, MXFP4, tables=(packed, scales, None)))
        delattr(module, proj)
        taken |= {f"{name}_blocks", f"{name}_scales"}
        holders[module_name] = module
    for module_name, module in holders.items():  # the quantized projections are [E, N, ...] already
        if not all(hasattr(module, f"{p}_quantized") for p in projections(module)):
            raise ValueError(f"{model_dir}: {module_name} has MXFP4 blocks for some of its projections only")
        module.is_transposed = False
    read_other_tensors(model, model_dir, files, read, taken, dtype)
    check_none_missing(model, model_dir)
    return model
