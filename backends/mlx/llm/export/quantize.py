"""Weight-only 2- to 8-bit and MXFP4 quantization of a model before export.

`quantize_model` replaces every `nn.Linear` of a model (and, when asked,
its input embedding) with modules that hold MLX's quantized layout (affine
intN, or mxfp4), computed by `mlx.core.quantize` itself, and call `mlx::quantized_linear` /
`mlx::quantized_embedding` (custom_kernel_ops/quantized.py); the expert
weights of mixture-of-experts layers (llm/export/experts.py) are quantized per
expert and run with `mlx::gather_quantized_linear`. A layer whose
input width does not divide by the group size is an error naming the layer,
never silently left in full precision.

The input embedding is quantized too unless `embedding=False` (or, left to
the default, when its type or width is not one we can quantize). Tied
input/output embeddings stay one table: quantized for both uses, or left in
full precision for both (quantizing only the output side would store the
table twice); a tied table left in float32 is what a decode step reads most.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from ...custom_kernel_ops.quantized import BITS, QuantFormat
from ...lowering.weight_files import keep, trim_heap
from ...progress import counter
from .experts import projections, route_experts

# export's --quantize names: int2 .. int8 (no 7 bits in MLX) and mxfp4
QUANTIZE_MODES = (*(f"int{bits}" for bits in BITS), "mxfp4")


def quantize_format(name: str, group_size: int | None = None) -> QuantFormat:
    """The format of a --quantize name; group_size defaults to 64 (intN), 32 (mxfp4, its only size)."""
    if name not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {name!r}")
    if name == "mxfp4":
        return QuantFormat(4, group_size or 32, "mxfp4")
    return QuantFormat(int(name[3:]), group_size or 64)


# Rows quantized at once: MLX's copies of a few of them, not of a whole
# [vocab, hidden] output layer, are in memory at a time.
CHUNK_BYTES = 64 << 20


def quantize_weight(weight: torch.Tensor, fmt: QuantFormat):
    """(packed int32 [N, K*bits/32], scales [N, K/g], biases [N, K/g]) of a [N, K]
    weight, computed by mlx.core.quantize in the weight's dtype, a chunk of
    rows at a time (each row is quantized on its own); fmt.bf16_params:
    scales and biases then rounded to bfloat16. mxfp4: uint8 scales, biases
    None."""
    import mlx.core as mx

    def to_mx(rows: torch.Tensor) -> mx.array:
        if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
            return mx.view(mx.array(rows.contiguous().view(torch.int16).numpy()), mx.bfloat16)
        return mx.array(rows.detach().contiguous().numpy())

    params = torch.bfloat16 if fmt.bf16_params else weight.dtype

    def to_torch(a):  # numpy has no bfloat16: widen, then narrow (exact, but for bf16_params' rounding)
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(params)

    weight = weight.detach()
    step = max(1, CHUNK_BYTES // max(1, weight.shape[1] * weight.element_size()))
    affine = fmt.mode == "affine"  # else E8M0 exponents (uint8) as they are, and no biases
    parts = []
    for start in range(0, weight.shape[0], step):
        packed, scales, *biases = mx.quantize(to_mx(weight[start:start + step]), group_size=fmt.group_size,
                                              bits=fmt.bits, mode=fmt.mode)
        parts.append((torch.from_numpy(np.array(packed).view(np.int32)),
                      to_torch(scales) if affine else torch.from_numpy(np.array(scales)),
                      to_torch(biases[0]) if affine else None))
    mx.clear_cache()  # MLX keeps freed buffers for reuse: give them back, and the heap's
    trim_heap()
    # in files while export runs (lowering/weight_files.py): one weight at a time in memory
    return tuple(None if parts[0][i] is None else keep(torch.cat([part[i] for part in parts])) for i in range(3))


class QuantizedTable(torch.nn.Module):
    """A quantized [N, K] matrix: as a linear layer (x @ W^T) and as an embedding (rows of W)."""

    def __init__(self, weight: torch.Tensor | None, fmt: QuantFormat, embed_scale: torch.Tensor | None = None,
                 tables: tuple | None = None, dtype: torch.dtype | None = None):
        """Quantizes `weight`, or holds `tables` (packed, scales, biases: an
        mlx-lm folder's, llm/export/mlx_folders.py) as they are; as an embedding its
        rows come out in `dtype` (default: the weight's, or the scales')."""
        super().__init__()
        packed, scales, biases = tables if tables is not None else quantize_weight(weight, fmt)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)
        self.fmt = fmt
        self.out_dtype = dtype or (weight.dtype if weight is not None else scales.dtype)
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 32 // fmt.bits
        # Gemma3's scaled word embedding multiplies its output by this.
        self.embed_scale = None if embed_scale is None else float(embed_scale)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mlx.quantized_linear(x, self.qweight, self.scales, self.biases, bias,
                                              self.fmt.group_size, self.fmt.bits, self.fmt.mode)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.mlx.quantized_embedding(ids, self.qweight, self.scales, self.biases, self.fmt.group_size,
                                                 self.fmt.bits, self.fmt.mode, self.out_dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale


class QuantizedLinear(torch.nn.Module):
    """nn.Linear on a QuantizedTable (shared with the input embedding when tied)."""

    def __init__(self, table: QuantizedTable, bias: torch.Tensor | None):
        super().__init__()
        self.table = table
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table.linear(x, self.bias)


class QuantizedExperts(torch.nn.Module):
    """A mixture-of-experts projection's [E, N, K] weights, each expert's
    [N, K] quantized as a linear layer's."""

    def __init__(self, weight: torch.Tensor | None, fmt: QuantFormat, tables: tuple | None = None):
        """Quantizes `weight`, or holds `tables` ([E, N, ...] each: a checkpoint's, as they are)."""
        super().__init__()
        if tables is None:
            experts, out_features, in_features = weight.shape
            tables = quantize_weight(weight.reshape(experts * out_features, in_features), fmt)
            tables = tuple(None if t is None else t.reshape(experts, out_features, -1) for t in tables)
        for name, t in zip(("qweight", "scales", "biases"), tables):
            self.register_buffer(name, t)
        self.fmt = fmt

    def forward(self, x: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mlx.gather_quantized_linear(x, self.qweight, self.scales, self.biases, indices, bias,
                                                     self.fmt.group_size, self.fmt.bits, self.fmt.mode)


def embedding_scale(name: str, module: torch.nn.Module) -> torch.Tensor | None:
    """The output scale of an input embedding we know how to quantize; errors otherwise."""
    if type(module) is torch.nn.Embedding:
        scale = None
    elif isinstance(module, torch.nn.Embedding) and hasattr(module, "embed_scale"):
        scale = module.embed_scale  # Gemma3TextScaledWordEmbedding: rows * embed_scale
    else:
        raise ValueError(f"layer {name}: cannot quantize an input embedding of type {type(module).__name__}")
    if module.max_norm is not None:
        raise ValueError(f"layer {name}: cannot quantize an embedding with max_norm")
    return scale


def quantizable_embedding(name: str, module: torch.nn.Module, group_size: int) -> bool:
    """Whether an input embedding is one quantize_model can quantize."""
    try:
        embedding_scale(name, module)
    except ValueError:
        return False
    return module.weight.shape[1] % group_size == 0


def quantize_model(model: torch.nn.Module, fmt: QuantFormat, *, embedding: bool | None = None) -> list[str]:
    """Replaces the model's linear layers and input embedding in place;
    returns the names of the layers it quantized. `embedding`: True
    quantizes the input embedding or raises naming why it cannot; False
    keeps it; None (the default) quantizes it when it can."""
    group_size = fmt.group_size
    module_names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and embedding is None:
        embedding = quantizable_embedding(module_names[id(embed)], embed, group_size)
    tied = embed is not None and head is not None and head.weight is embed.weight

    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if tied and not embedding:
        targets = [(n, m) for n, m in targets if m is not head]
    if embedding and embed is not None:
        targets.append((module_names[id(embed)], embed))
    experts = [(f"{n}.{p}", model.get_submodule(n), p) for n in route_experts(model)
               for p in projections(model.get_submodule(n))
               if not hasattr(model.get_submodule(n), f"{p}_quantized")]  # a checkpoint's MXFP4 stays
    bad = [f"{n} (input width {m.weight.shape[1]})" for n, m in targets if m.weight.shape[1] % group_size]
    bad += [f"{n} (input width {getattr(m, p).shape[2]})" for n, m, p in experts if getattr(m, p).shape[2] % group_size]
    if bad:
        raise ValueError(f"cannot quantize with group size {group_size}: the input width of "
                         f"{', '.join(bad)} is not a multiple of it")

    # A tied weight is quantized once. The modules are looked up by name as
    # they are replaced, so that each full-precision weight is freed once
    # quantized (export reads it from a file, lowering/weight_files.py).
    users = collections.Counter(id(m.weight) for _, m in targets)
    tables: dict[int, QuantizedTable] = {}  # id(weight) -> table, while a module still uses the weight
    names = [name for name, _ in targets]
    embed_name = names[-1] if embedding and embed is not None else None
    del targets, embed, head
    with counter(f"quantizing to {fmt}", len(names) + len(experts)) as count:
        for name in names:
            module = model.get_submodule(name)
            scale = embedding_scale(name, module) if name == embed_name else None
            key = id(module.weight)
            table = tables.get(key) or QuantizedTable(module.weight, fmt, scale)
            if name == embed_name:
                table.embed_scale = None if scale is None else float(scale)
            users[key] -= 1
            if users[key]:
                tables[key] = table
            else:
                tables.pop(key, None)
            new = table if name == embed_name else QuantizedLinear(table, module.bias)
            parent, _, child = name.rpartition(".")
            del module
            setattr(model.get_submodule(parent) if parent else model, child, new)
            count.advance()
        for _, module, weight in experts:  # llm/export/experts.py reads `<weight>_quantized`
            setattr(module, f"{weight}_quantized", QuantizedExperts(getattr(module, weight), fmt))
            delattr(module, weight)
            count.advance()
    return names + [name for name, _, _ in experts]
