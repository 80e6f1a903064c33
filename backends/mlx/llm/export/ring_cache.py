"""Sliding-window layers on a ring buffer: cache memory that follows the window.

transformers' exportable static cache gives every layer `max_context` slots,
though a sliding-window layer only ever reads its last W positions. Here each
such layer gets R = W - 1 + max_chunk slots instead (`max_chunk`: the most
tokens one call takes, `ring_chunk`), position p in slot p % R, and a
buffer with the position each slot holds (stored + 1, so that 0, the value
of a reset cache, means empty). A call writes its L <= max_chunk keys and
values first, then attends over the ring with a mask made from those
positions: slot s is visible to the query at q when q - W < pos(s) <= q.

Why R = W - 1 + max_chunk is enough:
- the write of position q + i overwrites position q + i - R, which no query of
  the call needs (it is below q - W + 1 for every i < max_chunk);
- the caller may rewind: start again at a position up to `max_chunk` before
  the end of what it wrote (rejected draft tokens, llm/export/speculative.py), and
  the window of the new start is still there; stale slots of the positions
  after it hold positions above the query's, masked as any future one.
  A longer rewind (a conversation that changes an old turn) must prefill
  again from the start: `CACHE_REWIND` in the program's metadata says how far
  it may go (llm/run/runner.py).

The layers use transformers' attention through an attention function of
ours (registered with transformers, one per kind the family uses): with
sdpa, ring layers go to `mlx::written_attention` with the ring's mask; with
the family's own eager attention (attention sinks as in gpt-oss, soft-capping
as in Gemma 2), ring layers go to that function with the ring's mask as an
additive one. Every other layer runs as before.
"""

from __future__ import annotations

import inspect

import torch

from ...custom_kernel_ops import attention as _attention_op  # noqa: F401  (defines mlx::written_attention)

# Our attention function's name with transformers, per the family's attention.
RING_ATTENTION = {"sdpa": "executorch_mlx_ring", "eager": "executorch_mlx_ring_eager"}


def sliding_window(config) -> int | None:
    """W of a config whose `layer_types` has sliding-window layers, else None."""
    window = getattr(config, "sliding_window", None)
    if window and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return int(window)
    return None


def _eager_attention(module: torch.nn.Module):
    """The family's own eager attention function (in its modeling module), or None."""
    return getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def ring_chunk(model, max_context: int, min_chunk: int) -> int | None:
    """The most tokens one call takes when the sliding-window layers are on
    rings: a window (prefill stays a matrix product) and at least `min_chunk`
    (a verify call); None when a ring would not be shorter than the context,
    or the attention is neither sdpa nor the family's own eager function."""
    config = model.config.get_text_config()
    window = sliding_window(config)
    kind = getattr(config, "_attn_implementation", None)
    if window is None or kind not in RING_ATTENTION:
        return None
    if "reuse" in (getattr(config, "kv_sharing_modes", None) or ()):
        return None  # layers reading another layer's keys and values (Gemma 3n/4) would get its ring unmasked
    if kind == "eager" and not all(_eager_attention(m) for m in _attention_modules(model)):
        return None
    chunk = min(max_context - 1, max(window, min_chunk))
    return chunk if window - 1 + chunk < max_context else None


def _make_ring_layer():
    from transformers.cache_utils import StaticLayer

    class RingLayer(StaticLayer):
        """One sliding-window layer's ring (see the module's docstring); the
        tensors are the exported module's buffers, set by `CachedLM.forward`."""

        is_sliding = True

        def __init__(self, slots: int, window: int):
            super().__init__(max_cache_len=slots)
            self.window = window
            self.positions: torch.Tensor | None = None  # int64 [R]: position + 1 per slot, 0 = empty
            self.query_positions: torch.Tensor | None = None  # int64 [L]: this call's cache_position

        def update(self, key_states, value_states, *args, **kwargs):
            slots = torch.remainder(self.query_positions, self.max_cache_len)
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            self.positions.index_copy_(0, slots, self.query_positions + 1)
            return self.keys, self.values

        def visible(self) -> torch.Tensor:
            """bool [1, 1, L, R]: which slots each query of the call attends to."""
            held = self.positions.unsqueeze(0) - 1  # [1, R], -1: empty
            query = self.query_positions.unsqueeze(1)  # [L, 1]
            return ((held >= 0) & (held <= query) & (held > query - self.window)).unsqueeze(0).unsqueeze(0)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0  # transformers' mask for this layer goes unused

    return RingLayer


def _ring_attention(kind: str):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        ring = getattr(module, "_mlx_ring", None)
        attention_mask = _with_indexed_keys(attention_mask, kwargs.pop("indices", None), key.shape[-2])
        if kind == "eager":
            if ring is not None:  # additive, as transformers' eager masks
                attention_mask = torch.where(ring.visible(), 0.0, torch.finfo(query.dtype).min).to(query.dtype)
            return _eager_attention(module)(module, query, key, value, attention_mask, scaling=scaling,
                                            dropout=dropout, **kwargs)
        if ring is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        # only the slots up to the call's last position: the ring before it wraps costs what the position costs
        out = torch.ops.mlx.written_attention(query, key, value, ring.visible(), ring.query_positions, scale)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _with_indexed_keys(attention_mask, indices, keys: int):
    """The mask of an indexed-attention layer (DeepSeek-V3.2's kind), whose
    code hands an attention function other than transformers' own the keys
    each query attends to (`indices` [B, S, k]) instead of masking them out
    itself: the layer's mask with every other key masked."""
    if indices is None:
        return attention_mask
    batch, rows = indices.shape[:2]
    picked = torch.zeros(batch, rows, keys, dtype=torch.bool).scatter(-1, indices.long(), True).unsqueeze(1)
    if attention_mask.dtype == torch.bool:
        return attention_mask & picked
    return attention_mask.masked_fill(~picked, torch.finfo(attention_mask.dtype).min)


def _register_attention(kind: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    name = RING_ATTENTION[kind]
    AttentionInterface.register(name, _ring_attention(kind))
    # the other layers' masks, as for the family's own attention
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask if kind == "sdpa" else eager_mask)
    return name


def use_rings(model, wrapper: torch.nn.Module, cache, chunk: int) -> dict[int, object]:
    """Puts the sliding-window layers of `model` (exported through `wrapper`,
    whose buffers `key_cache_i`/`value_cache_i` are `cache`'s) on rings for
    calls of up to `chunk` tokens; returns {layer index: ring layer}."""
    config = model.config.get_text_config()
    window = sliding_window(config)
    slots = window - 1 + chunk
    ring_layer = _make_ring_layer()
    rings = {}
    for i, kind in enumerate(config.layer_types):
        if kind != "sliding_attention":
            continue
        full = cache.layers[i]
        ring = rings[i] = ring_layer(slots, window)
        ring.lazy_initialization(full.keys[:, :, :slots], full.values[:, :, :slots])
        wrapper.register_buffer(f"key_cache_{i}", ring.keys, persistent=False)
        wrapper.register_buffer(f"value_cache_{i}", ring.values, persistent=False)
        wrapper.register_buffer(f"ring_positions_{i}", torch.zeros(slots, dtype=torch.int64), persistent=False)
        cache.layers[i] = ring
    for module in _attention_modules(model):
        if module.layer_idx in rings:
            module._mlx_ring = rings[module.layer_idx]
    # (the text config: the one the attention modules and the text model's masks read)
    config._attn_implementation = _register_attention(config._attn_implementation)
    return rings
