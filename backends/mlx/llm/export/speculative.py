"""Speculative verification inside the program (docs/sampling.md,
"Speculative verification").

An LLM program exported with `max_draft_tokens` K > 0 verifies drafts in the
same `forward` that prefills and decodes; the number of rows it samples is
the number of rows of its `history` input (R in [1, K + 1]):

    input_ids       [1, S]   ..., x, d_1 .. d_n    (n = R - 1 drafts last)
    cache_position  [S]      their positions
    position        []       t: the decode step of the token after x
    history         [R, H]   row i: the penalty history of the token after
                             d_i (plain decoding's history at step t + i)
    the other sampler inputs as for one row (the same for every row)

Row i is the logits after x, d_1 .. d_i, sampled with position t + i. The
program returns the emitted tokens, int64 [R]: d_1 .. d_a (the longest
prefix of drafts equal to the tokens sampled before them) then the token
sampled at row a, and -1 after those a + 1 (and their logprobs, -inf after).
One host read per round. A prefill chunk or a decode step is R = 1: the
token sampled after the last input, as without verification.

Cache entries written for rejected drafts are never read: the next call
starts at the position after the last emitted token and overwrites them
(attention never looks past the position it is at).
"""

from __future__ import annotations

import torch

from ...custom_kernel_ops import verification  # noqa: F401  (defines mlx::accepted_prefix)
from ...serialization.sampler_params import PARAMS
from ..sampler_inputs import TABLE_PARAMS
from .sampling import token_logprobs, top_token_logprobs


def verify(lm: torch.nn.Module, input_ids: torch.Tensor, cache_position: torch.Tensor, sampler: dict,
           logprobs: bool, top_logprobs: int = 0):
    """The program's forward with verification (see the module doc):
    `sampler` holds the sampler inputs by name (None: not taken). With
    `logprobs`, the emitted tokens' log-probabilities follow, then, with
    `top_logprobs` K, each row's K most likely tokens and theirs."""
    rows = sampler["history"].shape[0]
    logits = lm(input_ids, cache_position, rows)[0]  # [R, V]
    position = sampler["position"] + torch.arange(rows)
    params = []
    for name in PARAMS:
        value = sampler.get(name)
        if value is not None and name in TABLE_PARAMS and name != "history":
            value = value.expand(rows, -1)  # one table for every row
        params.append(value)
    sampled = torch.ops.mlx.sample(logits, sampler["temperature"], sampler["seed"], position, *params)
    emitted = torch.ops.mlx.accepted_prefix(sampled, input_ids)
    if not logprobs:
        return emitted
    return (emitted, token_logprobs(logits, emitted)) + (top_token_logprobs(logits, top_logprobs)
                                                          if top_logprobs else ())
