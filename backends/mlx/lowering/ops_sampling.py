"""`mlx::sample` -> RandomBitsNode (the row's random words) + SampleNode;
`mlx::accepted_prefix` -> AcceptedPrefixNode.

The whole of docs/sampling.md runs in SampleNode (a native kernel on CPUs, MLX
ops elsewhere); the graph only supplies two 32-bit random words per row:
from (seed, position) when seeded, MLX's global key sequence otherwise, and
zeros for a greedy-only sampler (no temperature: GreedyHead).
"""

from __future__ import annotations

import torch

from ..custom_kernel_ops import sample, verification  # noqa: F401  (define the ops)
from ..serialization import ir
from ..serialization.sampler_params import PARAMS
from .builder import GraphBuilder, meta_val, node_arg
from .registry import Unsupported, handles


@handles(torch.ops.mlx.sample.default)
def lower_sample(b: GraphBuilder, node: torch.fx.Node) -> None:
    logits = b.get(node_arg(node, 0, "logits"))
    if len(logits.shape) != 2 or isinstance(logits.shape[1], torch.SymInt):
        raise Unsupported("sample needs [B, V] logits with a static V (B may be dynamic)")
    rows = logits.shape[0]
    seed, position = node_arg(node, 2, "seed"), node_arg(node, 3, "position")
    if (seed is None) != (position is None):
        raise Unsupported("sample: seed and position must be given together")
    temperature = node_arg(node, 1, "temperature")
    if temperature is None:  # greedy only: no randomness at all
        temperature = b.literal(0.0, torch.float32)
        random = b.emit(ir.FullNode, torch.uint32, (rows, 2), shape=b.dims((rows, 2)),
                        value=b.literal(0, torch.uint32).tid, dtype=ir.DType.uint32)
    else:
        temperature = b.get(temperature)
        random = b.emit(ir.RandomBitsNode, torch.uint32, (rows, 2), shape=b.dims((rows, 2)), width=4,
                        seed=b.get(seed).tid if seed is not None else None,
                        position=b.get(position).tid if position is not None else None)
    params = {}
    for index, name in enumerate(PARAMS, start=4):  # after logits, temperature, seed, position
        arg = node_arg(node, index, name)
        if arg is not None:
            params[name] = b.get(arg).tid
    out = meta_val(node)
    if tuple(out.shape) != (rows,):
        raise Unsupported(f"sample output shape {tuple(out.shape)}")
    if seed is not None:  # a native kernel derives the row's words from them itself
        params.update(seed=b.get(seed).tid, position=b.get(position).tid)
    b.bind(node, b.emit(ir.SampleNode, torch.int64, (rows,), logits=logits.tid, temperature=temperature.tid,
                        random=random.tid, **params))


@handles(torch.ops.mlx.accepted_prefix.default)
def lower_accepted_prefix(b: GraphBuilder, node: torch.fx.Node) -> None:
    sampled, fed = b.get(node.args[0]), b.get(node.args[1])
    if len(sampled.shape) != 1 or sampled.dtype != torch.int64 or len(fed.shape) != 2:
        raise Unsupported("accepted_prefix needs sampled [R] int64 and fed [1, S]")
    b.bind(node, b.emit(ir.AcceptedPrefixNode, torch.int64, sampled.shape, sampled=sampled.tid, fed=fed.tid))
