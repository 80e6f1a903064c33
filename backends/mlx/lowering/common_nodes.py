"""One IR node per distinct computation.

An exported decoder repeats the same small computations in every layer (the
cache positions, the written length of the cache, the RoPE tables' views):
torch.export keeps each layer's copy, and each costs the runtime an MLX array
and a scheduled task per call. Nodes with the same kind, the same inputs and
the same attributes compute the same value, so all but the first are dropped
and their readers pointed at the first.
"""

from __future__ import annotations

import dataclasses

from ..serialization import ir

# Two draws are two draws, even with equal arguments.
_NOT_MERGED = (ir.RandomBitsNode,)


def _remap(op, to: dict[int, int]) -> None:
    """Points every value `op` reads at its replacement (Tid and IntOrSlot are
    frozen: replaced, not changed)."""

    def new(item):
        if isinstance(item, ir.Tid) and item.idx in to:
            return ir.Tid(to[item.idx])
        if isinstance(item, ir.IntOrSlot) and item.slot >= 0 and item.slot in to:
            return ir.IntOrSlot(value=item.value, slot=to[item.slot])
        return item

    for f in dataclasses.fields(op):
        if f.name != "out":
            v = getattr(op, f.name)
            setattr(op, f.name, [new(i) for i in v] if isinstance(v, list) else new(v))


def _key(v):
    if isinstance(v, list):
        return tuple(_key(i) for i in v)
    if isinstance(v, ir.Tid):
        return ("tid", v.idx)
    if isinstance(v, ir.IntOrSlot):
        return ("dim", v.value, v.slot)
    if isinstance(v, float):
        return ("float", repr(v))  # nan equals nan; -0.0 is not 0.0
    if dataclasses.is_dataclass(v):
        return (type(v).__name__,) + tuple(_key(getattr(v, f.name)) for f in dataclasses.fields(v))
    return (type(v).__name__, v)


def merge_common_nodes(graph: ir.Graph) -> int:
    """Drops every node that repeats an earlier one; returns how many."""
    to: dict[int, int] = {}
    first: dict[tuple, int] = {}
    kept = []
    for node in graph.nodes:
        op = node.op
        _remap(op, to)
        if not isinstance(op, _NOT_MERGED):
            key = (type(op).__name__,) + tuple(_key(getattr(op, f.name)) for f in dataclasses.fields(op)
                                               if f.name != "out")
            if key in first:
                to[op.out.idx] = first[key]
                continue
            first[key] = op.out.idx
        kept.append(node)
    for io in graph.outputs:
        io.slot = to.get(io.slot, io.slot)
    for buffer in graph.mutable_buffers:
        buffer.update = to.get(buffer.update, buffer.update)
    dropped = len(graph.nodes) - len(kept)
    graph.nodes = kept
    return dropped


def reads(op) -> list[int]:
    """The value slots an IR node reads (every Tid, [Tid] and run-time size field)."""
    slots = []
    for f in dataclasses.fields(op):
        v = getattr(op, f.name)
        items = v if isinstance(v, list) else [v]
        for item in items:
            if isinstance(item, ir.Tid) and f.name != "out":
                slots.append(item.idx)
            elif isinstance(item, ir.IntOrSlot) and item.slot >= 0:
                slots.append(item.slot)
    return slots


def drop_dead_nodes(graph: ir.Graph) -> None:
    """Removes nodes whose results nothing uses (e.g. the pieces of a pattern
    that was lowered as one fused node)."""
    live = {io.slot for io in graph.outputs} | {b.update for b in graph.mutable_buffers}
    kept = []
    for node in reversed(graph.nodes):
        if node.op.out.idx in live:
            kept.append(node)
            live.update(reads(node.op))
    graph.nodes = kept[::-1]
