"""`mlx::quantized_linear` / `mlx::quantized_embedding` -> QuantizedLinearNode /
QuantizedEmbeddingNode (the ops and their layout: custom_kernel_ops/quantized.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import quantized  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .registry import handles


@handles(torch.ops.mlx.quantized_linear.default)
def lower_quantized_linear(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x, weight, scales, biases = (b.get(a) for a in node.args[:4])
    fields = dict(x=b.cast(x, out.dtype).tid, weight=weight.tid, scales=b.cast(scales, out.dtype).tid,
                  biases=b.cast(biases, out.dtype).tid, group_size=node.args[5], bits=node.args[6])
    bias = node_arg(node, 4, "bias")
    if bias is not None:
        fields["bias"] = b.cast(b.get(bias), out.dtype).tid
    b.bind(node, b.emit(ir.QuantizedLinearNode, out.dtype, out.shape, **fields))


@handles(torch.ops.mlx.quantized_embedding.default)
def lower_quantized_embedding(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    ids, weight, scales, biases = (b.get(a) for a in node.args[:4])
    b.bind(node, b.emit(ir.QuantizedEmbeddingNode, out.dtype, out.shape, indices=ids.tid, weight=weight.tid,
                        scales=scales.tid, biases=biases.tid, group_size=node.args[4], bits=node.args[5]))
