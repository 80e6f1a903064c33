"""`mlx::gated_delta` / `mlx::ssd_scan` -> GatedDeltaNode / SsdScanNode (the
recurrences of state layers: the ops are in custom_kernel_ops/state.py, their
use in llm/state_cache.py)."""

from __future__ import annotations

import torch

from ..custom_kernel_ops import state  # noqa: F401  (defines the ops)
from ..serialization import ir
from .builder import GraphBuilder, meta_val
from .registry import Unsupported, handles


def _static(node: torch.fx.Node, *dims) -> None:
    if any(isinstance(d, torch.SymInt) for d in dims):
        raise Unsupported(f"{node.target} with dynamic heads or state sizes")


@handles(torch.ops.mlx.gated_delta.default)
def lower_gated_delta(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    q, k, v, g, beta, s = (b.get(a) for a in node.args[:6])
    _static(node, q.shape[1], q.shape[3], v.shape[3])
    b.bind(node, b.emit(ir.GatedDeltaNode, out.dtype, out.shape, q=q.tid, k=k.tid, v=v.tid, g=g.tid, beta=beta.tid,
                        state=s.tid, snapshots=int(node.args[6])))


@handles(torch.ops.mlx.ssd_scan.default)
def lower_ssd_scan(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x, dt, a, bb, c, s = (b.get(arg) for arg in node.args[:6])
    _static(node, x.shape[1], x.shape[3], bb.shape[3])
    b.bind(node, b.emit(ir.SsdScanNode, out.dtype, out.shape, x=x.tid, dt=dt.tid, a=a.tid, b=bb.tid, c=c.tid,
                        state=s.tid, snapshots=int(node.args[6])))
