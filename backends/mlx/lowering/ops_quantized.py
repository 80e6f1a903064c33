"""`mlx::quantized_linear` / `mlx::quantized_embedding` -> QuantizedLinearNode /
QuantizedEmbeddingNode (the ops and their layout: custom_kernel_ops/quantized.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import quantized  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, ir_dtype, meta_val, node_arg
from .registry import handles


# Affine scales and biases the runtime reads as they are, whatever x's dtype.
PARAM_DTYPES = (torch.float32, torch.bfloat16)


def quantized_tables(b: GraphBuilder, node: torch.fx.Node, first: int, dtype: torch.dtype, mode_index: int) -> dict:
    """The node fields of a quantized table: weight, scales, biases (args
    `first`.. `first + 2`) and the mode; affine's scales and biases as they
    are when float32 or bfloat16, else in `dtype`."""
    mode = node_arg(node, mode_index, "mode", "affine")
    weight, scales, biases = (node.args[first + i] for i in range(3))
    fields = dict(weight=b.get(weight).tid, mode=ir.QuantMode[mode])
    if mode == "affine":
        params = [b.get(scales), b.get(biases)]
        if not (params[0].dtype == params[1].dtype and params[0].dtype in PARAM_DTYPES):
            params = [b.cast(p, dtype) for p in params]
        fields.update(scales=params[0].tid, biases=params[1].tid)
    else:  # the microscaling formats: uint8 exponents as they are, no biases
        fields["scales"] = b.get(scales).tid
    return fields


@handles(torch.ops.mlx.quantized_linear.default)
def lower_quantized_linear(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    fields = dict(x=b.cast(b.get(node.args[0]), out.dtype).tid, group_size=node.args[5], bits=node.args[6],
                  float_activations=b.float_activations, **quantized_tables(b, node, 1, out.dtype, 7))
    bias = node_arg(node, 4, "bias")
    if bias is not None:
        fields["bias"] = b.cast(b.get(bias), out.dtype).tid
    b.bind(node, b.emit(ir.QuantizedLinearNode, out.dtype, out.shape, **fields))


@handles(torch.ops.mlx.quantized_embedding.default)
def lower_quantized_embedding(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    tables = quantized_tables(b, node, 1, out.dtype, 6)
    b.bind(node, b.emit(ir.QuantizedEmbeddingNode, out.dtype, out.shape, indices=b.get(node.args[0]).tid,
                        group_size=node.args[4], bits=node.args[5], dtype=ir_dtype(out.dtype), **tables))
