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
                                             logit_bias_ids (-1 pads), logit_bias_values

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
import math

import torch
from executorch.exir import ExecutorchBackendConfig, ExecutorchProgramManager, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass

from ..partitioner import MLXPartitioner
from ..serialization.sampler_params import BY_NAME, PARAMS, ROW_PARAMS, SAMPLER_INPUTS as _TABLE, TABLE_PARAMS
from . import program_contract

# Sampler inputs of a program, in order (model inputs come first).
SAMPLER_INPUTS = tuple(p.name for p in _TABLE)
# The value that turns each per-row parameter off.
OFF = {name: BY_NAME[name].off for name in ROW_PARAMS}
# Parameters that count tokens in the history (the penalties).
PENALTIES = tuple(name for name in PARAMS if BY_NAME[name].needs == "history")


def _dtype(name: str) -> torch.dtype:
    return torch.int64 if BY_NAME[name].integer else torch.float32


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


# ------------------------------------------------------ host-side checks --
def _int64_param(name: str, value, unsigned_ok: bool = False) -> torch.Tensor:
    """An integer scalar or [B] parameter as int64; TypeError/ValueError naming it."""
    t = value if isinstance(value, torch.Tensor) else None
    if t is None:
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise TypeError(f"{name} must be an int (or ints), got {value!r}")
        hi = 2**64 if unsigned_ok else 2**63
        if not all(-(2**63) <= v < hi for v in items):
            raise ValueError(f"{name} must fit in 64 bits{' (signed)' if not unsigned_ok else ''}, got {value!r}")
        # keep all 64 bits of a seed >= 2**63 in an int64
        items = [v - 2**64 if v >= 2**63 else v for v in items]
        t = torch.tensor(items if isinstance(value, (list, tuple)) else items[0], dtype=torch.int64)
    elif t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.to(torch.int64)


def _float_param(name: str, value) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple, torch.Tensor)):
        raise TypeError(f"{name} must be a number (or numbers), got {value!r}")
    try:
        t = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number (or numbers), got {value!r}") from None
    if isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype == torch.int64):
        raise TypeError(f"{name} must be a float tensor, got {value.dtype}")
    return t


def _row_param(name: str, value, batch: int) -> torch.Tensor:
    spec = BY_NAME[name]
    t = _int64_param(name, value) if spec.integer else _float_param(name, value)
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or have {batch} values (the batch), got shape {list(t.shape)}")
    lo, lo_closed, hi, hi_closed = spec.valid
    if not bool((((t >= lo) if lo_closed else (t > lo)) & ((t <= hi) if hi_closed else (t < hi))).all()):
        raise ValueError(f"{name} must be {spec.expect}, got {t.tolist()}")
    return t


def _table(name: str, value, batch: int, dtype: torch.dtype, vocab: int | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a {dtype} tensor [{batch}, N], got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} tensor, got {value.dtype}")
    if value.dim() != 2 or value.shape[0] != batch:
        raise ValueError(f"{name} must be [{batch}, N] (one row per batch row), got {list(value.shape)}")
    if dtype == torch.int64 and vocab is not None and bool(((value < -1) | (value >= vocab)).any()):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}) or -1 (padding)")
    if dtype.is_floating_point and bool(torch.isnan(value).any()):
        raise ValueError(f"{name} must not contain NaN")
    return value


def sampling_inputs(batch: int, temperature=1.0, seed=None, position=None, *, vocab: int | None = None,
                    **params) -> dict[str, torch.Tensor]:
    """Checks the sampling parameters on the host (TypeError/ValueError naming
    the parameter, before anything runs); returns those given as tensors, in
    the program's input order. `params` are SAMPLER_INPUTS names."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(PARAMS)}")
    out = {"temperature": _row_param("temperature", temperature, batch)}
    if seed is not None:
        out["seed"] = _int64_param("seed", seed, unsigned_ok=True)
        out["position"] = _int64_param("position", 0 if position is None else position)
        if bool((out["position"] < 0).any()):
            raise ValueError(f"position must be >= 0 (the decode step), got {position!r}")
        for name in ("seed", "position"):
            if out[name].dim() > 1 or (out[name].dim() == 1 and out[name].shape[0] != batch):
                raise ValueError(f"{name} must be a scalar or have {batch} values (the batch), "
                                 f"got shape {list(out[name].shape)}")
    elif position is not None:
        raise ValueError("position is only meaningful with a seed")
    for name in PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if name in ROW_PARAMS:
            out[name] = _row_param(name, value, batch)
        else:
            out[name] = _table(name, value, batch, _dtype(name), vocab)
    for name in out:
        other = BY_NAME[name].together
        if other and other not in out:
            raise ValueError(f"{name} and {other} are given together")
        if other and out[name].shape != out[other].shape:
            raise ValueError(f"{name} {list(out[name].shape)} and {other} {list(out[other].shape)} "
                             f"must have one shape")
    return out


FLOAT32_MAX = 3.4028234663852886e38


def logit_bias_tensors(bias: dict[int, float], slots: int,
                       vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """{token id: value} as ([1, slots] ids, [1, slots] values), -1 padded.
    Ids must be in [0, vocab): -1 would be taken for padding and ignored."""
    if not isinstance(bias, dict) or not all(isinstance(k, int) and not isinstance(k, bool) for k in bias):
        raise TypeError(f"logit_bias must be a dict {{token id: value}}, got {bias!r}")
    if len(bias) > slots:
        raise ValueError(f"logit_bias has {len(bias)} entries; this program takes at most {slots}")
    ids = torch.full((1, slots), -1, dtype=torch.int64)
    values = torch.zeros(1, slots)
    for j, (k, v) in enumerate(bias.items()):
        if not (0 <= k < (vocab if vocab is not None else 2**63)):
            raise ValueError(f"logit_bias: token id {k} is outside [0, {vocab if vocab is not None else 2**63})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
            raise ValueError(f"logit_bias[{k}] must be a number (-inf bans the token), got {v!r}")
        if not math.isinf(v) and abs(v) > FLOAT32_MAX:
            raise ValueError(f"logit_bias[{k}] = {v!r} does not fit in float32 (use inf or -inf)")
        ids[0, j], values[0, j] = k, float(v)
    return ids, values


def program_inputs(names: list[str], shapes: dict[str, tuple], given: dict[str, torch.Tensor]) -> list:
    """The sampler inputs a program takes (`names`, with their exported
    shapes), from checked `given` values; what is not given is off.
    ValueError for a given parameter the program does not take."""
    extra = [n for n in given if n not in names]
    if extra:
        raise ValueError(f"this program was exported without {', '.join(extra)}; it takes "
                         f"{', '.join(names) or 'no sampling inputs'} (re-export with them)")
    out = []
    for name in names:
        shape = shapes[name]
        value = given.get(name)
        table = name in TABLE_PARAMS
        if value is None:
            if name == "seed":
                raise ValueError("this program is seeded: pass a seed")
            if name == "temperature":
                value = torch.tensor(1.0)
            else:  # off (a table: all padding)
                value = torch.full(shape if table else (), BY_NAME[name].off, dtype=_dtype(name))
        if table:
            if value.shape[1] > shape[1]:
                if name != "history":
                    raise ValueError(f"{name} has {value.shape[1]} entries per row; this program takes {shape[1]}")
                value = value[:, -shape[1]:]  # the most recent tokens
            if value.shape[1] < shape[1]:
                fill = torch.full((shape[0], shape[1] - value.shape[1]), -1 if value.dtype == torch.int64 else 0,
                                  dtype=value.dtype)
                value = torch.cat([value, fill], dim=1)
        elif tuple(value.shape) != shape:
            if value.dim() != 0:
                raise ValueError(f"{name} must have shape {list(shape)} for this program, got {list(value.shape)}")
            value = value.expand(shape)  # one value for every row
        out.append(value.contiguous())
    return out


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
                     history_size: int = 0, logit_bias_size: int = 0) -> dict[str, torch.Tensor]:
    """Example values of the sampler inputs a program takes, in input order."""
    for name in params:
        if name not in ROW_PARAMS:
            raise ValueError(f"unknown sampling parameter {name!r}; known: {', '.join(ROW_PARAMS)}")
    if any(p in params for p in PENALTIES) != (history_size > 0):
        raise ValueError("the penalties (repetition, frequency, presence) count tokens in a history: give "
                         "history_size > 0 with at least one of them, and not without")
    if history_size < 0 or logit_bias_size < 0:
        raise ValueError("history_size and logit_bias_size must be >= 0")
    shape = (batch,) if per_row else ()
    examples = {"temperature": torch.ones(shape)}
    if seeded:
        examples["seed"] = torch.zeros(shape, dtype=torch.int64)
        examples["position"] = torch.zeros(shape, dtype=torch.int64)
    for name in ROW_PARAMS:
        if name in params:
            examples[name] = torch.full(shape, OFF[name], dtype=_dtype(name))
    sizes = {"history": history_size, "logit_bias_ids": logit_bias_size, "logit_bias_values": logit_bias_size}
    for name in TABLE_PARAMS:
        if sizes[name]:
            examples[name] = torch.full((batch, sizes[name]), BY_NAME[name].off, dtype=_dtype(name))
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
    logprobs: bool = False,
    **params: bool,
) -> ExecutorchProgramManager:
    """Exports `SamplingHead(model, logprobs)` and lowers it with MLXPartitioner.

    Each row parameter of the table set True (`<name>=True`) becomes a
    runtime input (see the module doc for the order); `history_size` H > 0
    adds the [B, H] history the penalties count, `logit_bias_size` N > 0 the
    [B, N] logit bias. `per_row` makes the per-row parameters [B] inputs
    instead of scalars. Returns the ExecuTorch program (`.buffer` is the
    .pte); its metadata (llm/program_contract.py) names every input.
    """
    unknown = sorted(set(params) - set(ROW_PARAMS))
    if unknown:
        raise TypeError(f"export_sampling_head got unknown parameter(s) {', '.join(unknown)}; "
                        f"known: {', '.join(ROW_PARAMS)}")
    batch = _check_model_args(model_args)
    kwargs = sampler_examples(batch, seeded=seeded, per_row=per_row,
                              params=tuple(name for name in ROW_PARAMS if params.get(name)),
                              history_size=history_size, logit_bias_size=logit_bias_size)
    head = SamplingHead(model, logprobs=logprobs).eval()
    ep = torch.export.export(head, tuple(model_args), kwargs, strict=strict)
    return _lower(ep, logprobs)


def export_greedy_head(model: torch.nn.Module, model_args: tuple, *, strict: bool = False) -> ExecutorchProgramManager:
    _check_model_args(model_args)
    ep = torch.export.export(GreedyHead(model).eval(), tuple(model_args), strict=strict)
    return _lower(ep, False)


def _lower(ep: torch.export.ExportedProgram, logprobs: bool) -> ExecutorchProgramManager:
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    meta = program_contract.head_metadata(names, logprobs)
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()], constant_methods=meta)
    # Inputs are not memory-planned: ExecuTorch hands the caller's tensors
    # (the logits, often megabytes) to the delegate instead of copying them.
    return edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False)))
