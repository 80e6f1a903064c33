"""`mlx::gather_linear` / `mlx::gather_quantized_linear` -> GatherLinearNode /
GatherQuantizedLinearNode (mixture-of-experts projections: the ops are in
custom_kernel_ops/experts.py, their use in llm/export/experts.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import experts  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .ops_quantized import quantized_tables
from .registry import handles


def _bias(b: GraphBuilder, node: torch.fx.Node, index: int, dtype: torch.dtype) -> dict:
    bias = node_arg(node, index, "bias")
    return {} if bias is None else {"bias": b.cast(b.get(bias), dtype).tid}


@handles(torch.ops.mlx.gather_linear.default)
def lower_gather_linear(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x, weight, indices = (b.get(a) for a in node.args[:3])
    b.bind(node, b.emit(ir.GatherLinearNode, out.dtype, out.shape, x=b.cast(x, out.dtype).tid,
                        weight=b.cast(weight, out.dtype).tid, indices=indices.tid, **_bias(b, node, 3, out.dtype)))


@handles(torch.ops.mlx.gather_quantized_linear.default)
def lower_gather_quantized_linear(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.cast(b.get(node.args[0]), out.dtype)
    b.bind(node, b.emit(ir.GatherQuantizedLinearNode, out.dtype, out.shape, x=x.tid,
                        indices=b.get(node.args[4]).tid, group_size=node.args[6], bits=node.args[7],
                        float_activations=b.float_activations, **quantized_tables(b, node, 1, out.dtype, 8),
                        **_bias(b, node, 5, out.dtype)))
