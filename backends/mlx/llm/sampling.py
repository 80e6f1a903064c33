"""Sampling heads: wrap a logits model so the exported program returns token ids.

Exported method inputs, in this order (C++ callers pass them the same way):

    model inputs...,  temperature (float32 [] or [B]),
    seed (int64 [] or [B]), position (int64 [] or [B])   # seeded exports only

`temperature` <= 0 selects greedy decoding for that row at run time.
`seed` is one 64-bit seed per request (or one for the batch); `position` is
the decode step of that row: pass 0 for the first generated token and add
one per step, keeping the seed. A seeded row's token is a pure function of
(seed, position) and its logits, whatever the batch size or row index.
Programs exported without a seed have no seed/position inputs and draw from
MLX's global random key sequence.
"""

from __future__ import annotations

import torch
from executorch.exir import ExecutorchProgramManager, to_edge_transform_and_lower

from ..custom_kernel_ops import sample as _sample_op  # noqa: F401  (defines torch.ops.mlx.sample)
from ..partitioner import MLXPartitioner


def last_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, S, V] -> the last position's [B, V]; [B, V] passes through."""
    if logits.dim() == 3:
        return logits[:, -1, :]
    if logits.dim() == 2:
        return logits
    raise ValueError(f"the model must return [B, S, vocab] or [B, vocab] logits, got {list(logits.shape)}")


class SamplingHead(torch.nn.Module):
    """`model(*args) -> logits` becomes `head(*args, temperature, seed, position) -> ids[B]`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *model_args, temperature, seed=None, position=None, **model_kwargs):
        logits = last_logits(self.model(*model_args, **model_kwargs))
        return torch.ops.mlx.sample(logits, temperature, seed, position)


class GreedyHead(torch.nn.Module):
    """Argmax decoding (lowest index on ties, NaN never chosen); no extra inputs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *model_args, **model_kwargs):
        logits = last_logits(self.model(*model_args, **model_kwargs)).float()
        logits = torch.where(torch.isnan(logits), float("-inf"), logits)
        return torch.argmax(logits, dim=-1)


def validate_temperature(temperature) -> None:
    """Host-side check: ValueError naming the parameter, before anything runs."""
    t = torch.as_tensor(temperature, dtype=torch.float32)
    if t.dim() > 1:
        raise ValueError(f"temperature must be a scalar or a [B] tensor, got shape {list(t.shape)}")
    if bool((t < 0).any()):
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t.tolist()}")


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


def sampling_inputs(batch: int, temperature=1.0, seed=None, position=None) -> dict[str, torch.Tensor]:
    """The head's keyword inputs as tensors, in the exported order."""
    validate_temperature(temperature)
    kwargs = {"temperature": torch.as_tensor(temperature, dtype=torch.float32)}
    if seed is not None:
        kwargs["seed"] = _int64_param("seed", seed, unsigned_ok=True)
        kwargs["position"] = _int64_param("position", 0 if position is None else position)
        if bool((kwargs["position"] < 0).any()):
            raise ValueError(f"position must be >= 0 (the decode step), got {position!r}")
    elif position is not None:
        raise ValueError("position is only meaningful with a seed")
    for name, value in kwargs.items():
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != batch):
            raise ValueError(f"{name} must be a scalar or have {batch} rows (the batch), got shape {list(value.shape)}")
    return kwargs


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


def export_sampling_head(
    model: torch.nn.Module,
    model_args: tuple,
    *,
    seeded: bool = True,
    per_row: bool = False,
    strict: bool = False,
) -> ExecutorchProgramManager:
    """Exports `SamplingHead(model)` and lowers it with MLXPartitioner.

    `per_row` makes temperature/seed/position [B] inputs (one per row)
    instead of scalars. Returns the ExecuTorch program (`.buffer` is the .pte).
    """
    batch = _check_model_args(model_args)
    shape = (batch,) if per_row else ()
    kwargs = {"temperature": torch.ones(shape, dtype=torch.float32)}
    if seeded:
        kwargs["seed"] = torch.zeros(shape, dtype=torch.int64)
        kwargs["position"] = torch.zeros(shape, dtype=torch.int64)
    ep = torch.export.export(SamplingHead(model).eval(), tuple(model_args), kwargs, strict=strict)
    return to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch()


def export_greedy_head(model: torch.nn.Module, model_args: tuple, *, strict: bool = False) -> ExecutorchProgramManager:
    _check_model_args(model_args)
    ep = torch.export.export(GreedyHead(model).eval(), tuple(model_args), strict=strict)
    return to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch()

