"""Projections of one input fused into one product.

An attention block multiplies its input by q, k and v; an MLP by gate and
up. Each product is a node of its own at run time: on the CPU each
quantizes (or lays out) the same x again, wakes the kernel's threads and
returns, and between two products one core idles. Here every group of
`mlx::quantized_linear` calls (or of float `aten.linear` calls) on the same
input, with weights in the same format, becomes one call over the weights
stacked row after row, followed by a slice per original call (views at run
time).

Each output row of a product depends only on x and its own weight row (its
groups' scales and biases included), and our kernels compute each row on its
own, so the fused program computes the same values, bit for bit, as the
unfused one (OpenBLAS, where a CPU without AVX-512 takes it for a prefill,
may round a row differently by its place in the matrix).
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ...lowering.weight_files import stack_rows

QUANTIZED_LINEAR = torch.ops.mlx.quantized_linear.default
LINEAR = torch.ops.aten.linear.default
# The arguments of each product after x that are stacked along the output rows.
_STACKED = {QUANTIZED_LINEAR: 4, LINEAR: 2}  # (weight, scales, biases, bias; weight, bias)


def _operands(node: torch.fx.Node) -> list:
    """The stacked arguments of a product (_STACKED), None where not given."""
    count = _STACKED[node.target]
    return [node.args[i] if i < len(node.args) else None for i in range(1, 1 + count)]


def _fusable(node: torch.fx.Node, ep: ExportedProgram) -> tuple | None:
    """The key of what a product can be fused with (its kind, format and
    which of its operands exist), or None when it cannot be: an operand
    computed in the program, not a weight."""
    from ...lowering.builder import constant_tensor

    operands = _operands(node)
    if node.kwargs or any(
            a is not None and (not isinstance(a, torch.fx.Node) or constant_tensor(ep, a) is None) for a in operands):
        return None
    if node.target == LINEAR:
        weight, bias = operands
        return (LINEAR, constant_tensor(ep, weight).dtype, bias is None)
    weight, scales, biases, bias = operands
    return (QUANTIZED_LINEAR, tuple(node.args[5:]), biases is None, bias is None, constant_tensor(ep, scales).dtype)


def fuse_shared_input_projections(ep: ExportedProgram) -> int:
    """Rewrites `ep` in place; returns how many products were fused away.
    The stacked weights wait in files like the others, written from the
    originals' files (lowering/weight_files.py); the originals are left
    unread, for drop_unused_constants to remove."""
    from executorch.backends.transforms.utils import create_constant_placeholder

    from ...lowering.builder import constant_tensor

    graph = ep.graph_module.graph
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _STACKED:
            key = _fusable(node, ep)
            if key is not None:
                groups.setdefault((node.args[0], key), []).append(node)
    first_input = next(n for n in graph.nodes if n.op == "placeholder")
    fused = 0
    for (x, _), nodes in groups.items():
        if len(nodes) < 2:
            continue
        op, count = nodes[0].target, _STACKED[nodes[0].target]
        stacked = []
        for i, parts in enumerate(zip(*(_operands(n) for n in nodes)), start=1):
            if parts[0] is None:
                stacked.append(None)
                continue
            name = f"emlx_fused_{nodes[0].name}_{i}"
            with graph.inserting_before(first_input):
                stacked.append(create_constant_placeholder(
                    ep, graph, name, InputKind.BUFFER, stack_rows([constant_tensor(ep, p) for p in parts]),
                    persistent_buffer=True))
        with graph.inserting_before(nodes[0]):
            rest = tuple(nodes[0].args[1 + count:])  # (the quantized format)
            product = graph.call_function(op, (x, *stacked, *rest))
            product.meta = dict(nodes[0].meta)
            product.meta["val"] = op(x.meta["val"], *(s if s is None else s.meta["val"] for s in stacked), *rest)
            last = product.meta["val"].dim() - 1
            start, parts = 0, []
            for node in nodes:
                rows = constant_tensor(ep, node.args[1]).shape[0]
                part = graph.call_function(torch.ops.aten.slice.Tensor, (product, last, start, start + rows))
                part.meta = dict(node.meta)
                part.meta["val"] = torch.ops.aten.slice.Tensor(product.meta["val"], last, start, start + rows)
                parts.append(part)
                start += rows
        for node, part in zip(nodes, parts):  # (after the inserts: they went before the first of these)
            node.replace_all_uses_with(part)
            graph.erase_node(node)
        fused += len(nodes) - 1
    if fused:
        graph.lint()
        ep.graph_module.recompile()
    return fused
