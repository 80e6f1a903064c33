"""`mlx::quantized_linear` / `mlx::quantized_embedding` -> QuantizedLinearNode /
QuantizedEmbeddingNode (the ops and their layout: custom_kernel_ops/quantized.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import quantized  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, ir_dtype, meta_val, node_arg
from .registry import handles


def quantized_tables(b: GraphBuilder, node: torch.fx.Node, first: int, dtype: torch.dtype, mode_index: int) -> dict:
    """The node fields of a quantized table: weight, scales, biases (args
    `first`.. `first + 2`) and the mode; affine's scales and biases in `dtype`."""
    mode = node_arg(node, mode_index, "mode", "affine")
    weight, scales, biases = (node.args[first + i] for i in range(3))
    fields = dict(weight=b.get(weight).tid, mode=ir.QuantMode[mode])
    if mode == "affine":
        fields.update(scales=b.cast(b.get(scales), dtype).tid, biases=b.cast(b.get(biases), dtype).tid)
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
    tables = quantized_tables(b, node, 1, node.args[2].meta["val"].dtype, 6)  # affine: rows in the scales' type
    b.bind(node, b.emit(ir.QuantizedEmbeddingNode, out.dtype, out.shape, indices=b.get(node.args[0]).tid,
                        group_size=node.args[4], bits=node.args[5], dtype=ir_dtype(out.dtype), **tables))
