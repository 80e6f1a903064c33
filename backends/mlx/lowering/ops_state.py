"""`mlx::gated_delta` / `mlx::ssd_scan` / `mlx::selective_scan` -> GatedDeltaNode /
SsdScanNode / SelectiveScanNode (the
recurrences of state layers: the ops are in custom_kernel_ops/state.py, their
use in llm/export/state_cache.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import state  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, meta_val
from .registry import Unsupported, handles


def _lower_scan(b: GraphBuilder, node: torch.fx.Node, node_cls, fields: tuple[str, ...]) -> None:
    """Each op: six tensors (the fields, in the op's argument order), then the snapshot count."""
    out = meta_val(node)
    values = dict(zip(fields, (b.get(a) for a in node.args[:6])))
    state = values["state"]
    if any(isinstance(d, torch.SymInt) for d in (*values[fields[0]].shape[3:], *state.shape[1:])):
        raise Unsupported(f"{node.target} with dynamic heads or state sizes")
    # (the states of the call's last positions only: what the op's reference returns)
    b.bind(node, b.emit(node_cls, out.dtype, out.shape, snapshots=int(node.args[6]), call_states_only=True,
                        **{name: v.tid for name, v in values.items()}))


@handles(torch.ops.mlx.gated_delta.default)
def lower_gated_delta(b: GraphBuilder, node: torch.fx.Node) -> None:
    _lower_scan(b, node, ir.GatedDeltaNode, ("q", "k", "v", "g", "beta", "state"))


@handles(torch.ops.mlx.ssd_scan.default)
def lower_ssd_scan(b: GraphBuilder, node: torch.fx.Node) -> None:
    _lower_scan(b, node, ir.SsdScanNode, ("x", "dt", "a", "b", "c", "state"))


@handles(torch.ops.mlx.selective_scan.default)
def lower_selective_scan(b: GraphBuilder, node: torch.fx.Node) -> None:
    _lower_scan(b, node, ir.SelectiveScanNode, ("x", "dt", "a", "b", "c", "state"))
