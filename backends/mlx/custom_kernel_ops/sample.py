"""`mlx::sample`: draw one token id per row from logits (see SAMPLING.md).

    torch.ops.mlx.sample(logits[B, V], temperature[] or [B],
                         seed=None ([] or [B] int64), position=None) -> int64[B]

* temperature <= 0 or NaN selects greedy decoding (argmax, lowest index on
  ties) for that row, at run time: no re-export, no host synchronisation.
* seeded (seed given): row b's draw is a pure function of (seed[b],
  position[b]) and its logits, whatever the batch. `position` is required
  with a seed: a decode loop passes its step counter.
* unseeded: MLX's global key sequence (the reference uses torch's).
* NaN logits count as -inf; if a row has +inf logits the draw is uniform
  among them; a row with neither finite nor +inf logits yields -1.

The CPU reference below is exact (inverse CDF in float64 on float32
z = (logits - row max) / T). The MLX lowering draws with the Gumbel-max trick from
RandomBitsNode bits.
"""

from __future__ import annotations

import torch

from ..lowering.builder import GraphBuilder, Value, meta_val
from ..lowering.registry import Unsupported, handles
from ..serialization import ir

torch.library.define(
    "mlx::sample",
    "(Tensor logits, Tensor temperature, Tensor? seed=None, Tensor? position=None) -> Tensor",
)

_MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """SplitMix64's finalizer; the runtime applies the same to fold positions."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(seed: int, position: int) -> int:
    """The 64-bit key seed of row (seed, position), as the runtime derives it."""
    return mix64((seed & _MASK64) ^ mix64(position & _MASK64))


def _per_row(t: torch.Tensor | None, rows: int, name: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != rows):
        raise ValueError(f"mlx::sample: {name} must be a scalar or have shape [{rows}], got {list(t.shape)}")
    return t.reshape(-1).expand(rows)


def check_args(logits, temperature, seed, position) -> None:
    if logits.dim() != 2:
        raise ValueError(f"mlx::sample: logits must be [B, V], got {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"mlx::sample: logits must be floating point, got {logits.dtype}")
    if not temperature.dtype.is_floating_point:
        raise ValueError(f"mlx::sample: temperature must be a float tensor, got {temperature.dtype}")
    if (seed is None) != (position is None):
        raise ValueError("mlx::sample: seed and position are given together (position is the decode step)")
    for name, t in (("seed", seed), ("position", position)):
        if t is not None and t.dtype != torch.int64:
            raise ValueError(f"mlx::sample: {name} must be int64, got {t.dtype}")


def _uniforms(rows: int, seeds, positions) -> torch.Tensor:
    """One float64 uniform per row: from (seed, position) when seeded."""
    if seeds is None:
        return torch.rand(rows, dtype=torch.float64)
    return torch.stack([
        torch.rand((), dtype=torch.float64,
                   generator=torch.Generator().manual_seed(stream_seed(int(s), int(p))))
        for s, p in zip(seeds.tolist(), positions.tolist())
    ])


@torch.library.impl("mlx::sample", "CompositeExplicitAutograd")
def sample_reference(logits, temperature, seed=None, position=None):
    """Exact reference: inverse-CDF draw in float64 from softmax(float32 z)."""
    check_args(logits, temperature, seed, position)
    rows, vocab = logits.shape
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    temps = _per_row(temperature.float(), rows, "temperature")
    posinf = torch.isposinf(x)
    any_posinf = posinf.any(dim=1, keepdim=True)
    # SAMPLING.md step 3: subtract the row max first (logits / T may overflow
    # float32 for tiny T), and -inf stays -inf whatever T (-inf / inf is NaN)
    row_max = x.amax(dim=1, keepdim=True) if vocab else x.new_zeros(rows, 1)
    scaled = torch.where(x > float("-inf"), (x - row_max) / temps[:, None], float("-inf"))
    z = torch.where(any_posinf, torch.where(posinf, 0.0, float("-inf")), scaled)
    has_candidate = x.amax(dim=1) > float("-inf") if vocab else torch.zeros(rows, dtype=torch.bool)
    # rows without candidates get a harmless uniform distribution, masked below
    z = torch.where(has_candidate[:, None], z, 0.0).double()
    cdf = torch.softmax(z, dim=1).cumsum(dim=1)
    u = _uniforms(rows, _per_row(seed, rows, "seed"), _per_row(position, rows, "position"))
    # first index whose cdf exceeds u * total: never a zero-probability token
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    greedy = torch.argmax(x, dim=1)
    token = torch.where(temps > 0, sampled, greedy)
    return torch.where(has_candidate, token, -1)


@torch.library.register_fake("mlx::sample")
def _sample_fake(logits, temperature, seed=None, position=None):
    check_args(logits, temperature, seed, position)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


# ------------------------------------------------------------ lowering --
F32 = torch.float32


def _as_column(b: GraphBuilder, v: Value, rows: int) -> Value:
    """A [] or [B] per-row parameter as something that broadcasts over [B, V]."""
    if len(v.shape) == 0:
        return v
    return b.reshape(v, (rows, 1))


@handles(torch.ops.mlx.sample.default)
def lower_sample(b: GraphBuilder, node: torch.fx.Node) -> None:
    args = list(node.args) + [None] * (4 - len(node.args))
    logits_arg, temp_arg = args[0], args[1]
    seed_arg = node.kwargs.get("seed", args[2])
    pos_arg = node.kwargs.get("position", args[3])
    logits = b.get(logits_arg)
    if len(logits.shape) != 2 or any(isinstance(d, torch.SymInt) for d in logits.shape):
        raise Unsupported("sample needs static [B, V] logits")
    rows, vocab = logits.shape
    shape = (rows, vocab)

    emit = b.emit

    def binop(op_cls, x: Value, y: Value, dtype=F32, shp=shape) -> Value:
        return emit(op_cls, dtype, shp, a=x.tid, b=y.tid)

    def where(c: Value, x: Value, y: Value, dtype, shp) -> Value:
        return emit(ir.WhereNode, dtype, shp, condition=c.tid, x=x.tid, y=y.tid)

    neg_inf, pos_inf = b.literal(float("-inf"), F32), b.literal(float("inf"), F32)
    # float32 logits with NaN -> -inf
    x = b.cast(logits, F32)
    x = where(emit(ir.IsNanNode, torch.bool, shape, a=x.tid), neg_inf, x, F32, shape)
    row_max = emit(ir.MaxNode, F32, (rows, 1), a=x.tid, axes=[1], keepdims=True)

    # greedy branch: argmax, lowest index on ties (MLX returns the first max)
    greedy = b.cast(emit(ir.ArgmaxNode, torch.int32, (rows,), a=x.tid, axis=1, keepdims=False), torch.int64)

    # sampling branch: z = x / T; a row with +inf logits samples among them
    temp = b.cast(b.get(temp_arg), F32)
    # SAMPLING.md step 3: z = (x - row max) / T, which cannot overflow for
    # tiny T; -inf stays -inf whatever T (-inf / inf would be NaN)
    z = binop(ir.DivideNode, binop(ir.SubtractNode, x, row_max), _as_column(b, temp, rows))
    z = where(binop(ir.GreaterNode, x, neg_inf, torch.bool), z, neg_inf, F32, shape)
    any_posinf = binop(ir.EqualNode, row_max, pos_inf, torch.bool, (rows, 1))
    only_posinf = where(emit(ir.IsPosInfNode, torch.bool, shape, a=x.tid), b.literal(0.0, F32), neg_inf, F32, shape)
    z = where(any_posinf, only_posinf, z, F32, shape)

    # Gumbel-max: u in (0, 1) exactly from the top 23 bits; z + Gumbel noise
    # is z - log(-log u)
    seed = b.get(seed_arg) if seed_arg is not None else None
    position = b.get(pos_arg) if pos_arg is not None else None
    if (seed is None) != (position is None):
        raise Unsupported("sample: seed and position must be given together")
    bits = emit(ir.RandomBitsNode, torch.uint32, shape, shape=b.dims(shape),
                seed=seed.tid if seed else None, position=position.tid if position else None, width=4)
    top23 = emit(ir.RightShiftNode, torch.uint32, shape, a=bits.tid, b=b.literal(9, torch.uint32).tid)
    u = binop(ir.AddNode, b.cast(top23, F32), b.literal(0.5, F32))
    u = binop(ir.MultiplyNode, u, b.literal(2.0**-23, F32))
    exponential = emit(ir.NegativeNode, F32, shape, a=emit(ir.LogNode, F32, shape, a=u.tid).tid)
    noisy = binop(ir.SubtractNode, z, emit(ir.LogNode, F32, shape, a=exponential.tid))
    sampled = b.cast(emit(ir.ArgmaxNode, torch.int32, (rows,), a=noisy.tid, axis=1, keepdims=False), torch.int64)

    # per row: greedy unless T > 0 (NaN compares false); -1 without candidates
    is_sampling = binop(ir.GreaterNode, temp, b.literal(0.0, F32), torch.bool, temp.shape)
    token = where(is_sampling, sampled, greedy, torch.int64, (rows,))
    has_candidate = binop(ir.GreaterNode, row_max, neg_inf, torch.bool, (rows, 1))
    has_candidate = emit(ir.SqueezeNode, torch.bool, (rows,), a=has_candidate.tid, axes=[1])
    token = where(has_candidate, token, b.literal(-1, torch.int64), torch.int64, (rows,))
    out = meta_val(node)
    if tuple(out.shape) != (rows,):
        raise Unsupported(f"sample output shape {tuple(out.shape)}")
    b.bind(node, token)
