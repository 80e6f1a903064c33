"""Sampling heads: wrap a logits model so the exported program returns token ids.

`SamplingHead(model)(*model_args, temperature, seed=None, position=None,
**params)`: every sampling parameter of docs/sampling.md is a keyword (the
table in serialization/sampler_params.py names them); one given at export
becomes a runtime input of the program, one left None is off and absent from
it. Exported method inputs, in this order (C++ callers pass them the same
way; runners read the names from the program's metadata, see
llm/program_contract.py):

    model inputs...
    temperature          float32 [] or [B]   <= 0: greedy for that row
    seed, position       int64 [] or [B]     seeded exports only
    the row parameters   [] or [B]           the table's dtype; its off value: off
    the tables           [B, N]              history (ids the penalties count),
                                             logit_bias_ids (-1 pads), logit_bias_values,
                                             token_bitmask (int32 [B, ceil(V/32)])

`seed` is one 64-bit seed per request (or one for the batch); `position` is
the decode step of that row: pass 0 for the first generated token and add
one per step, keeping the seed. A seeded row's token is a pure function of
(seed, position) and its inputs, whatever the batch size or row index.
Programs exported without a seed draw from MLX's global random key sequence.
`SamplingHead(model, logprobs=True)` also returns the float32 [B]
log-probability of each chosen token under log_softmax of the raw logits.
"""

from __future__ import annotations

import inspect

from typing import TYPE_CHECKING

import torch

from ...serialization.sampler_params import BY_NAME, PARAMS, ROW_PARAMS, TABLE_PARAMS, mask_words
from .. import program_contract
from ..sampler_inputs import OFF, PENALTIES, SAMPLER_INPUTS, TOKEN_MASK

if TYPE_CHECKING:
    from executorch.exir import ExecutorchProgramManager

def llm_forward_signature() -> inspect.Signature:
    """An LLM program's forward by input name, for torch.export (dynamic
    shapes and input names follow it): the contract's inputs, then every
    sampler input in its order, the token mask last and optional (a program
    without a grammar input)."""
    return inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           default=None if name == TOKEN_MASK else inspect.Parameter.empty)
         for name in ("self", *program_contract.LLM_INPUTS, *SAMPLER_INPUTS)])


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, BY_NAME[name].dtype)


def last_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, S, V] -> the last position's [B, V]; [B, V] passes through."""
    if logits.dim() == 3:
        return logits[:, -1, :]
    if logits.dim() == 2:
        return logits
    raise ValueError(f"the model must return [B, S, vocab] or [B, vocab] logits, got {list(logits.shape)}")


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax of the raw logits (NaN as -inf) at each row's id; -inf for id -1."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    # a select-and-sum over the row, not a gather: it lowers for any batch
    chosen = torch.arange(x.shape[-1]) == ids[:, None]
    picked = torch.where(chosen, torch.log_softmax(x, dim=-1), 0.0).sum(dim=-1)
    return torch.where(ids >= 0, picked, float("-inf"))


def top_token_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens under log_softmax of the raw logits
    (NaN as -inf): ids int64 [R, k] and their log-probabilities [R, k], most
    likely first (equal values in index order)."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    values, ids = torch.topk(torch.log_softmax(x, dim=-1), k, dim=-1)
    return ids, values


class SamplingHead(torch.nn.Module):
    """`model(*args) -> logits` becomes `head(*args, temperature, ...) -> ids[B]`
    (and logprobs[B] with `logprobs=True`)."""

    def __init__(self, model: torch.nn.Module, logprobs: bool = False):
        super().__init__()
        self.model = model
        self.logprobs = logprobs

    def forward(self, *model_args, temperature, seed=None, position=None, **kwargs):
        params = [kwargs.pop(name, None) for name in PARAMS]  # the rest are the model's
        logits = last_logits(self.model(*model_args, **kwargs))
        ids = torch.ops.mlx.sample(logits, temperature, seed, position, *params)
        return (ids, token_logprobs(logits, ids)) if self.logprobs else ids

    # The parameters by name, for torch.export (it names a program's inputs after them).
    forward.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("model_args", inspect.Parameter.VAR_POSITIONAL),
         inspect.Parameter("temperature", inspect.Parameter.KEYWORD_ONLY)]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
           for name in SAMPLER_INPUTS[1:]]
        + [inspect.Parameter("model_kwargs", inspect.Parameter.VAR_KEYWORD)])


class GreedyHead(torch.nn.Module):
    """Argmax decoding (lowest index on ties, NaN never chosen, -1 for a row
    with nothing to choose); no extra inputs: mlx::sample without a temperature."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *model_args, **model_kwargs):
        return torch.ops.mlx.sample(last_logits(self.model(*model_args, **model_kwargs)), None)


# ----------------------------------------------------------------- export --
def _check_model_args(model_args) -> int:
    """The batch size of the example inputs; ValueError for what cannot export."""
    if not isinstance(model_args, (tuple, list)) or not model_args:
        raise ValueError("model_args must be a non-empty tuple of example inputs (the first one [B, ...])")
    first = model_args[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError("model_args[0] must be a tensor whose first dimension is the batch")
    if first.shape[0] < 1:
        raise ValueError(f"model_args[0] has batch size {first.shape[0]}: a program samples at least one row")
    return first.shape[0]


def sampler_examples(batch: int, *, seeded: bool, per_row: bool, params: tuple[str, ...] = (),
                     history_size: int = 0, logit_bias_size: int = 0,
                     mask_words: int = 0) -> dict[str, torch.Tensor]:
    """Example values of the sampler inputs a program takes, in input order
    (`mask_words` > 0: a token bitmask input of that many words per row)."""
    for name in params:
        if name not in ROW_PARAMS:
            raise ValueError(f"unknown sampling parameter {name!r}; known: {', '.join(ROW_PARAMS)}")
    if any(p in params for p in PENALTIES) != (history_size > 0):
        raise ValueError("the penalties (repetition, frequency, presence) count tokens in a history: give "
                         "history_size > 0 with at least one of them, and not without")
    if history_size < 0 or logit_bias_size < 0 or mask_words < 0:
        raise ValueError("history_size, logit_bias_size and mask_words must be >= 0")
    shape = (batch,) if per_row else ()
    examples = {"temperature": torch.ones(shape)}
    if seeded:
        examples["seed"] = torch.zeros(shape, dtype=torch.int64)
        examples["position"] = torch.zeros(shape, dtype=torch.int64)
    for name in ROW_PARAMS:
        if name in params:
            examples[name] = torch.full(shape, OFF[name], dtype=_torch_dtype(name))
    sizes = {"history": history_size, "logit_bias_ids": logit_bias_size, "logit_bias_values": logit_bias_size,
             TOKEN_MASK: mask_words}
    for name in TABLE_PARAMS:
        if sizes[name]:
            examples[name] = torch.full((batch, sizes[name]), BY_NAME[name].off, dtype=_torch_dtype(name))
    return examples


def export_sampling_head(
    model: torch.nn.Module,
    model_args: tuple,
    *,
    seeded: bool = True,
    per_row: bool = False,
    strict: bool = False,
    history_size: int = 0,
    logit_bias_size: int = 0,
    token_mask: bool = False,
    logprobs: bool = False,
    **params: bool,
) -> ExecutorchProgramManager:
    """Exports `SamplingHead(model, logprobs)` and lowers it with MLXPartitioner.

    Each row parameter of the table set True (`<name>=True`) becomes a
    runtime input (see the module doc for the order); `history_size` H > 0
    adds the [B, H] history the penalties count, `logit_bias_size` N > 0 the
    [B, N] logit bias, `token_mask` the token bitmask (a grammar's mask,
    docs/sampling.md step 1). `per_row` makes the per-row parameters [B]
    inputs instead of scalars. Returns the ExecuTorch program (`.buffer` is the
    .pte); its metadata (llm/program_contract.py) names every input.
    """
    unknown = sorted(set(params) - set(ROW_PARAMS))
    if unknown:
        raise TypeError(f"export_sampling_head got unknown parameter(s) {', '.join(unknown)}; "
                        f"known: {', '.join(ROW_PARAMS)}")
    batch = _check_model_args(model_args)
    words = 0
    if token_mask:  # the words follow the vocabulary: the model's logits say how large it is
        with torch.no_grad():
            words = mask_words(last_logits(model(*model_args)).shape[-1])
    kwargs = sampler_examples(batch, seeded=seeded, per_row=per_row,
                              params=tuple(name for name in ROW_PARAMS if params.get(name)),
                              history_size=history_size, logit_bias_size=logit_bias_size, mask_words=words)
    head = SamplingHead(model, logprobs=logprobs).eval()
    ep = torch.export.export(head, tuple(model_args), kwargs, strict=strict)
    return _lower(ep, logprobs)


def export_greedy_head(model: torch.nn.Module, model_args: tuple, *, strict: bool = False) -> ExecutorchProgramManager:
    _check_model_args(model_args)
    ep = torch.export.export(GreedyHead(model).eval(), tuple(model_args), strict=strict)
    return _lower(ep, False)


def _lower(ep: torch.export.ExportedProgram, logprobs: bool) -> ExecutorchProgramManager:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from ...partitioner import MLXPartitioner

    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    meta = program_contract.head_metadata(names, logprobs)
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()], constant_methods=meta)
    # Inputs are not memory-planned: ExecuTorch hands the caller's tensors
    # (the logits, often megabytes) to the delegate instead of copying them.
    return edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False)))
