"""Attention that costs what the position costs, not what the cache holds.

transformers attends over the whole static cache (max_context slots) with a
mask that hides the slots not written yet, so every step pays for the
largest context the program was exported for. `attend_written_prefix`
rewrites each such attention in an exported LLM into `mlx::written_attention`
(custom_kernel_ops/attention.py), which attends over the slots up to the last
one written in this call: the same result for a causal decoder, at the cost
of the tokens actually attended to.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from ...custom_kernel_ops import attention  # noqa: F401  (defines mlx::written_attention)

aten = torch.ops.aten
# What transformers puts between a cache write and the attention reading it:
# repeat_kv for grouped-query attention, and nothing that selects slots.
_PASS_THROUGH = {aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.reshape.default,
                 aten.view.default, aten._unsafe_view.default, aten.alias.default}
_CACHE_WRITES = {aten.index_copy_.default, aten.index_copy.default}
# A batched program's write (llm/export/batched.py): cache[rows, :, positions] = ...
_ROW_WRITES = {aten.index_put_.default, aten.index_put.default}


def _passes_through(node) -> bool:
    """A node between a cache write and its attention that selects no slots
    (a batched program's cache is sliced to the call's rows, on axis 0)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return False
    return node.target in _PASS_THROUGH or (node.target == aten.slice.Tensor and node.args[1] == 0)


def _written_slots(arg, slots: int) -> torch.fx.Node | None:
    """The slot indices of the cache write feeding a key/value argument, if
    it is a whole cache of `slots` slots written along axis 2 (a batched
    cache's: each row's positions, [rows, S])."""
    node = arg
    while _passes_through(node):
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.meta["val"].shape[2] != slots:
        return None  # (a sliding-window cache may wrap around)
    if node.target in _CACHE_WRITES and node.args[1] == 2:
        return node.args[2]
    if node.target in _ROW_WRITES and len(node.args[1]) == 3 and node.args[1][1] is None:
        return node.args[1][2]
    return None


def _reshape_transposed_views(attention: torch.fx.Node) -> None:
    """`view`s of the output's transposes become `reshape`s. torch's CPU sdpa
    lays its output out [B, L, H, D] in memory, so a model's
    `.transpose(1, 2).contiguous()` left no node when it was traced, and a
    `view` follows the transpose directly (Arcee's AFMoE); our op's output is
    contiguous, its transpose is not, and only a reshape takes it (the same
    values: MLX's reshape never depends on the layout)."""
    shape_ops = (aten.transpose.int, aten.reshape.default, aten.view.default, aten.permute.default)
    pending = list(attention.users)
    while pending:  # through the shape ops that follow it
        node = pending.pop()
        if node.target in shape_ops:
            if node.target == aten.view.default:
                node.target = aten.reshape.default
            pending += node.users


def attend_written_prefix(ep: ExportedProgram, slots: int) -> int:
    """Rewrites, in place, every masked attention over a full static cache
    of `slots` slots (the max context; a batched program's has one more);
    returns how many."""
    graph = ep.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target != aten.scaled_dot_product_attention.default:
            continue
        q, k, v, *rest = node.args
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest)) | dict(node.kwargs)
        mask = options.get("attn_mask")
        if mask is None or options.get("dropout_p", 0.0) or options.get("is_causal", False):
            continue
        if options.get("enable_gqa", False):
            continue
        written = _written_slots(k, slots)
        if written is None or _written_slots(v, slots) is not written:
            continue
        if mask.meta["val"].shape[-1] not in (1, slots):
            continue
        scale = options.get("scale")
        if scale is None:
            scale = q.meta["val"].shape[-1] ** -0.5
        with graph.inserting_before(node):
            if written.meta["val"].dim() != 1:  # the op takes the slots written as one list
                flat = graph.call_function(aten.reshape.default, (written, [-1]))
                flat.meta["val"] = written.meta["val"].reshape(-1)
                written = flat
            new = graph.call_function(torch.ops.mlx.written_attention.default,
                                      (q, k, v, mask, written, float(scale)))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        _reshape_transposed_views(new)
        rewritten += 1
    if rewritten:
        ep.graph_module.recompile()
    return rewritten
