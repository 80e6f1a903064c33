"""`mlx::sample`: draw one token id per row from logits, per docs/sampling.md.

    torch.ops.mlx.sample(logits[B, V], temperature[] or [B], seed=None, position=None,
                         *PARAMS) -> int64[B]

* PARAMS are the optional parameters of the sampler table
  (serialization/sampler_params.py, generated from schema.fbs), in its order;
  each is a tensor or `None` (off): a row parameter is [] (all rows) or [B],
  a table [B, N] (-1 pads ids). `history` holds the token ids the penalties
  count; `logit_bias_ids` and `logit_bias_values` (-inf bans a token) come
  together; `token_bitmask` [B, ceil(V/32)] int32 allows token 32w + j
  where bit j of word w is set (a grammar's mask).
* temperature <= 0 or NaN selects greedy decoding (argmax of the penalized
  logits, lowest index on ties) for that row, at run time; temperature None
  is greedy for every row (no randomness in the program at all).
* seeded (seed given): row b's draw is a pure function of (seed[b],
  position[b]) and its inputs, whatever the batch. `position` is required
  with a seed: a decode loop passes its step counter.
* unseeded: MLX's global key sequence (the reference uses torch's).

This module defines the op, its exact CPU reference (filters in float32 z as
docs/sampling.md writes them, probabilities and the inverse-CDF draw in
float64) and its fake; the lowering is in `lowering/ops_sampling.py`.
"""

from __future__ import annotations

import torch

from ..serialization.sampler_params import BY_NAME, PARAMS, mask_words, stream_seed

torch.library.define(
    "mlx::sample",
    "(Tensor logits, Tensor? temperature, Tensor? seed=None, Tensor? position=None, "
    + ", ".join(f"Tensor? {name}=None" for name in PARAMS) + ") -> Tensor",
)


def _per_row(t: torch.Tensor | None, rows: int, name: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != rows):
        raise ValueError(f"mlx::sample: {name} must be a scalar or have shape [{rows}], got {list(t.shape)}")
    return t.reshape(-1).expand(rows)


def check_args(logits, temperature, seed, position, params: dict) -> None:
    """Structure (shapes, dtypes, what goes together): ValueError naming the input."""
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"mlx::sample: logits must be [B, V] with V >= 1, got {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"mlx::sample: logits must be floating point, got {logits.dtype}")
    rows = logits.shape[0]
    if temperature is not None:
        if not temperature.dtype.is_floating_point:
            raise ValueError(f"mlx::sample: temperature must be a float tensor, got {temperature.dtype}")
        _per_row(temperature, rows, "temperature")
    if (seed is None) != (position is None):
        raise ValueError("mlx::sample: seed and position are given together (position is the decode step)")
    for name, t in (("seed", seed), ("position", position)):
        if t is not None and t.dtype != torch.int64:
            raise ValueError(f"mlx::sample: {name} must be int64, got {t.dtype}")
        _per_row(t, rows, name)
    for name in PARAMS:
        t, spec = params.get(name), BY_NAME[name]
        if t is None:
            continue
        if spec.integer and t.dtype != getattr(torch, spec.dtype):
            raise ValueError(f"mlx::sample: {name} must be {spec.dtype}, got {t.dtype}")
        if not spec.integer and not t.dtype.is_floating_point:
            raise ValueError(f"mlx::sample: {name} must be a float tensor, got {t.dtype}")
        if spec.kind == "row":
            _per_row(t, rows, name)
        elif t.dim() != 2 or t.shape[0] != rows:
            raise ValueError(f"mlx::sample: {name} must be [{rows}, N], got {list(t.shape)}")
        elif name == "token_bitmask" and t.shape[1] != mask_words(logits.shape[1]):
            raise ValueError(f"mlx::sample: token_bitmask must be [{rows}, {mask_words(logits.shape[1])}] "
                             f"(32 tokens a word), got {list(t.shape)}")
        if spec.needs and params.get(spec.needs) is None:
            raise ValueError(f"mlx::sample: parameters that need a {spec.needs} were given without one ({name})")
        other = params.get(spec.together) if spec.together else t
        if other is None:
            raise ValueError(f"mlx::sample: {name} and {spec.together} are given together")
        if other.shape != t.shape:
            raise ValueError(f"mlx::sample: {name} {list(t.shape)} and {spec.together} {list(other.shape)} "
                             f"must have one shape")


def allowed_by(token_bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: bit j of word w allows token 32w + j (bits past V ignored)."""
    ids = torch.arange(vocab)
    words = token_bitmask.to(torch.int64)[:, ids // 32]  # as unsigned 32-bit words
    return ((words >> (ids % 32)) & 1).bool()


def _uniforms(rows: int, seeds, positions) -> torch.Tensor:
    """One float64 uniform per row: from (seed, position) when seeded."""
    if seeds is None:
        return torch.rand(rows, dtype=torch.float64)
    return torch.stack([
        torch.rand((), dtype=torch.float64,
                   generator=torch.Generator().manual_seed(stream_seed(int(s), int(p))))
        for s, p in zip(seeds.tolist(), positions.tolist())
    ])


def _nan_to_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), float("-inf"), x)


def _scatter_rows(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, the sum of `values` at `ids`; ids outside [0, V) (the -1 pads) go nowhere."""
    at = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    out = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32)
    return out.scatter_add_(1, at, values.float())[:, :vocab]


def penalized_logits(logits, history=None, repetition_penalty=None, frequency_penalty=None,
                     presence_penalty=None, logit_bias_ids=None, logit_bias_values=None,
                     token_bitmask=None) -> torch.Tensor:
    """docs/sampling.md step 1, in float32: NaN as -inf, penalties, the bias, then the mask."""
    rows, vocab = logits.shape
    x = _nan_to_neg_inf(logits.float())
    if history is not None:
        counts = _scatter_rows(history, torch.ones(history.shape), vocab)
        seen = counts > 0
        if repetition_penalty is not None:
            r = _per_row(repetition_penalty.float(), rows, "repetition_penalty")[:, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if frequency_penalty is not None:
            x = x - _per_row(frequency_penalty.float(), rows, "frequency_penalty")[:, None] * counts
        if presence_penalty is not None:
            x = x - _per_row(presence_penalty.float(), rows, "presence_penalty")[:, None] * seen.float()
        x = _nan_to_neg_inf(x)
    if logit_bias_ids is not None:
        x = _nan_to_neg_inf(x + _scatter_rows(logit_bias_ids, logit_bias_values, vocab))
    if token_bitmask is not None:
        x = torch.where(allowed_by(token_bitmask, vocab), x, float("-inf"))
    return x


def filtered_z(x: torch.Tensor, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """docs/sampling.md steps 3-6 on penalized logits x: float32 z, -inf where filtered out."""
    rows, vocab = x.shape
    neg_inf = float("-inf")
    temps = _per_row(temperature.float(), rows, "temperature")[:, None]
    row_max = x.amax(dim=1, keepdim=True)
    # step 3: subtract the row max first (x / T may overflow float32 for tiny
    # T), and -inf stays -inf whatever T (-inf / inf is NaN)
    z = torch.where(x > neg_inf, (x - row_max) / temps, neg_inf)
    posinf = torch.isposinf(x)
    z = torch.where(row_max == float("inf"), torch.where(posinf, 0.0, neg_inf), z)
    thr = torch.full((rows, 1), neg_inf)
    if top_k is not None:  # step 4: the K-th largest z, ties kept
        k = _per_row(top_k, rows, "top_k")[:, None]
        kth = z.sort(dim=1, descending=True).values.gather(1, (k - 1).clamp(0, vocab - 1))
        thr = torch.where((k > 0) & (k < vocab), kth, thr)
    if min_p is not None:  # step 5 (the max always stays)
        m = _per_row(min_p.float(), rows, "min_p")[:, None]
        thr = torch.maximum(thr, torch.where(m > 0, torch.log(m).clamp(max=0.0), neg_inf))
    z = torch.where(z >= thr, z, neg_inf)
    if top_p is not None:  # step 6, in float64 over the survivors
        p = _per_row(top_p.double(), rows, "top_p")[:, None]
        ordered = z.sort(dim=1, descending=True).values
        mass = torch.softmax(ordered.double(), dim=1)
        before = mass.cumsum(dim=1) - mass  # strictly more likely (up to ties, see below)
        kept = (before < p).sum(dim=1, keepdim=True).clamp(min=1)
        # the kept positions are a prefix; z >= its last value keeps whole tie groups
        last = ordered.gather(1, kept - 1)
        z = torch.where((p < 1) & (z < last), neg_inf, z)
    return z


@torch.library.impl("mlx::sample", "CompositeExplicitAutograd")
def sample_reference(logits, temperature, seed=None, position=None, *param_values, **param_kwargs):
    """Exact reference: inverse-CDF draw in float64 from softmax(float32 z).
    The parameters after position are PARAMS, by position or by name."""
    p = {**dict(zip(PARAMS, param_values)), **param_kwargs}
    check_args(logits, temperature, seed, position, p)
    rows, vocab = logits.shape
    if temperature is None:
        temperature = torch.zeros(())
    x = penalized_logits(logits, p.get("history"), p.get("repetition_penalty"), p.get("frequency_penalty"),
                         p.get("presence_penalty"), p.get("logit_bias_ids"), p.get("logit_bias_values"),
                         p.get("token_bitmask"))
    z = filtered_z(x, temperature, p.get("top_k"), p.get("top_p"), p.get("min_p"))
    has_candidate = x.amax(dim=1) > float("-inf")
    # rows without candidates get a harmless uniform distribution, masked below
    z = torch.where(has_candidate[:, None], z, 0.0).double()
    cdf = torch.softmax(z, dim=1).cumsum(dim=1)
    u = _uniforms(rows, _per_row(seed, rows, "seed"), _per_row(position, rows, "position"))
    # first index whose cdf exceeds u * total: never a zero-probability token
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    greedy = torch.argmax(x, dim=1)
    temps = _per_row(temperature.float(), rows, "temperature")
    token = torch.where(temps > 0, sampled, greedy)
    return torch.where(has_candidate, token, -1)


@torch.library.register_fake("mlx::sample")
def _sample_fake(logits, temperature, seed=None, position=None, *param_values, **param_kwargs):
    check_args(logits, temperature, seed, position, {**dict(zip(PARAMS, param_values)), **param_kwargs})
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)
