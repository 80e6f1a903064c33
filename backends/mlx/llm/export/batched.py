"""Programs that run several sequences at once (`export --max-batch N`).

A batched program's call takes B rows (B in [1, N]), each its own sequence:

    input_ids       int64 [B, S]   each row's tokens, its pads first
    cache_position  int64 [B, S]   each row's positions (a pad's: see below)
    the sampler inputs             one value per row ([B]; the tables [B, H])

and returns each row's next token, int64 [B] (and its logprob, and the top
log-probabilities). Row r of a call is row r of the KV cache, so a call of
B rows runs the first B sequences: one client costs what a B = 1 program
costs, and the server keeps its sequences in the lowest rows.

Rows of one call are as long as the longest: a row with fewer tokens puts
pads before them, at positions after its last one. No query of that row
reads those slots before the row's own tokens overwrite them (attention
looks at the slots up to a query's position), and the row's last column is
its last token, whose logits it samples. A pad past the context goes to the
scratch slot (the cache has one slot more than the context), which no
query reads. Every row's draws depend only on its seed and position, so a
sequence gets the same tokens alone or batched.

Built for families whose every layer attends over the whole context (no
sliding window shorter than it, no state or indexer caches); the others are
refused naming what is missing. Batched programs verify no drafts.
"""

from __future__ import annotations

import torch
from torch.export import Dim

from ...serialization.sampler_params import PARAMS
from .. import program_contract
from ..sampler_inputs import SAMPLER_INPUTS
from .ring_cache import sliding_window
from .sampling import llm_forward_signature, token_logprobs, top_token_logprobs
from .state_cache import find_state_layers, one_token_cache


def _row_cache_class():
    from transformers.cache_utils import Cache

    class RowCache(Cache):
        """transformers' cache interface over the program's per-row buffers:
        each call row writes its tokens at its own positions."""

        def __init__(self, owner: BatchedLM, positions: torch.Tensor):
            self.owner, self.positions, self.layers = owner, positions, []

        def update(self, keys, values, layer_idx, cache_kwargs=None):
            rows = keys.shape[0]
            k, v = getattr(self.owner, f"keys_{layer_idx}"), getattr(self.owner, f"values_{layer_idx}")
            index = torch.arange(rows)[:, None]
            k[index, :, self.positions] = keys.transpose(1, 2)
            v[index, :, self.positions] = values.transpose(1, 2)
            return k[:rows], v[:rows]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # (positions are given: transformers counts nothing from here)

    return RowCache


def check_batchable(model, max_context: int, written) -> None:
    """NotImplementedError naming what a batched program of `model` does not
    build yet."""
    name = type(model).__name__
    config = model.config.get_text_config()
    window = sliding_window(config)
    if window is not None and window < max_context:
        raise NotImplementedError(f"--max-batch for {name}: sliding-window layers (a window of {window} "
                                  f"tokens, shorter than the context) in batched programs")
    if find_state_layers(model, written):
        raise NotImplementedError(f"--max-batch for {name}: state caches (linear attention, Mamba, short "
                                  f"convolutions) in batched programs")
    layers = getattr(written, "layers", None)
    if not layers or not all(isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
                             and getattr(layer, "indexer_keys", None) is None for layer in layers):
        raise NotImplementedError(f"--max-batch for {name}: a cache other than keys and values per layer "
                                  f"(indexers, shared or compressed caches) in batched programs")
    if any(type(m).__name__ == "GPTNeoSelfAttention" for m in model.modules()):
        raise NotImplementedError(f"--max-batch for {name}: local attention in batched programs")


class BatchedLM(torch.nn.Module):
    """(input_ids [B, S], cache_position [B, S]) -> each row's last logits [B, V],
    over a KV cache of `max_batch` rows of max_context + 1 slots."""

    def __init__(self, model, max_context: int, max_batch: int):
        super().__init__()
        model.config.get_text_config().use_cache = True
        written = one_token_cache(model)
        check_batchable(model, max_context, written)
        self.model, self.slots = model, max_context + 1
        self.row_cache = _row_cache_class()
        dtype = next(model.parameters()).dtype
        for i, layer in enumerate(written.layers):
            (_, heads, _, key_dim), value_dim = layer.keys.shape, layer.values.shape[-1]
            self.register_buffer(f"keys_{i}", torch.zeros(max_batch, heads, self.slots, key_dim, dtype=dtype),
                                 persistent=False)
            self.register_buffer(f"values_{i}", torch.zeros(max_batch, heads, self.slots, value_dim, dtype=dtype),
                                 persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # each row's queries see the slots at or before their positions (a 4D
        # mask transformers takes as it is), never the scratch slot
        mask = torch.arange(self.slots)[None, None, None, :] <= cache_position[:, None, :, None]
        out = self.model(input_ids=input_ids, position_ids=cache_position, attention_mask=mask, use_cache=True,
                         past_key_values=self.row_cache(self, cache_position), cache_position=cache_position[0],
                         logits_to_keep=1)
        return out.logits[:, -1, :]


class SampledRows(torch.nn.Module):
    """BatchedLM with the sampler, each row with its own sampler inputs (the
    program contract's order; the token mask last, optional)."""

    def __init__(self, lm: BatchedLM, logprobs: bool, top_logprobs: int = 0):
        super().__init__()
        self.lm, self.logprobs, self.top_logprobs = lm, logprobs, top_logprobs

    def forward(self, input_ids, cache_position, *sampler):
        given = dict(zip(SAMPLER_INPUTS, sampler))
        logits = self.lm(input_ids, cache_position)
        ids = torch.ops.mlx.sample(logits, given["temperature"], given["seed"], given["position"],
                                   *(given.get(name) for name in PARAMS))
        if not self.logprobs:
            return ids
        return (ids, token_logprobs(logits, ids)) + (top_token_logprobs(logits, self.top_logprobs)
                                                      if self.top_logprobs else ())

    forward.__signature__ = llm_forward_signature()


def batched_example(sampler: dict[str, torch.Tensor], max_batch: int, max_chunk: int) -> tuple[tuple, dict]:
    """The example inputs and dynamic shapes of a batched program: two rows
    of three tokens, `sampler` (one row's examples) repeated per row."""
    rows, seq = Dim("rows", min=1, max=max_batch), Dim("seq", min=1, max=max_chunk)
    example = (torch.zeros(2, 3, dtype=torch.int64), torch.arange(3).repeat(2, 1))
    dynamic = {name: {0: rows, 1: seq} for name in program_contract.LLM_INPUTS}
    for name, value in sampler.items():
        example += (value.reshape(1, -1).expand(2, -1).contiguous() if value.dim() else value.repeat(2),)
        dynamic[name] = {0: rows}
    return example, dynamic
