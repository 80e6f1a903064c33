"""Sampler inputs on the host: the checks of every sampling parameter
(TypeError/ValueError naming it, before anything runs) and the assembly of a
program's sampler inputs in its order. Runners need only this, not the export
stack that llm/export/sampling.py pulls in."""

from __future__ import annotations

import math

import numpy as np

from ..loaded_program import as_array
from ..serialization.sampler_params import BY_NAME, PARAMS, ROW_PARAMS, SAMPLER_INPUTS as _TABLE, TABLE_PARAMS, mask_words

# Sampler inputs of a program, in order (model inputs come first).
SAMPLER_INPUTS = tuple(p.name for p in _TABLE)
# The value that turns each per-row parameter off.
OFF = {name: BY_NAME[name].off for name in ROW_PARAMS}
# Parameters that count tokens in the history (the penalties).
PENALTIES = tuple(name for name in PARAMS if BY_NAME[name].needs == "history")
# The grammar's token mask (docs/sampling.md step 1): an LLM export may leave it out.
TOKEN_MASK = "token_bitmask"


def param_dtype(name: str) -> np.dtype:
    return np.dtype(BY_NAME[name].dtype)


# ------------------------------------------------------ host-side checks --
def _int64_param(name: str, value, unsigned_ok: bool = False) -> np.ndarray:
    """An integer scalar or [B] parameter as int64; TypeError/ValueError naming it."""
    t = as_array(value)
    if t is None:
        items = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise TypeError(f"{name} must be an int (or ints), got {value!r}")
        hi = 2**64 if unsigned_ok else 2**63
        if not all(-(2**63) <= v < hi for v in items):
            raise ValueError(f"{name} must fit in 64 bits{' (signed)' if not unsigned_ok else ''}, got {value!r}")
        # keep all 64 bits of a seed >= 2**63 in an int64
        items = [v - 2**64 if v >= 2**63 else v for v in items]
        t = np.array(items if isinstance(value, (list, tuple)) else items[0], dtype=np.int64)
    elif t.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.astype(np.int64)


def _float_param(name: str, value) -> np.ndarray:
    t = as_array(value)
    if t is not None:
        if t.dtype.kind != "f" and t.dtype != np.int64:
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
        return t.astype(np.float32)
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
        raise TypeError(f"{name} must be a number (or numbers), got {value!r}")
    try:
        t = np.array(value, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"{name} must be a number (or numbers), got {value!r}") from None
    return t


def _row_param(name: str, value, batch: int) -> np.ndarray:
    spec = BY_NAME[name]
    t = _int64_param(name, value) if spec.integer else _float_param(name, value)
    if t.ndim > 1 or (t.ndim == 1 and t.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or have {batch} values (the batch), got shape {list(t.shape)}")
    lo, lo_closed, hi, hi_closed = spec.valid
    if not bool((((t >= lo) if lo_closed else (t > lo)) & ((t <= hi) if hi_closed else (t < hi))).all()):
        raise ValueError(f"{name} must be {spec.expect}, got {t.tolist()}")
    return t


def _table(name: str, value, batch: int, dtype: np.dtype, vocab: int | None) -> np.ndarray:
    t = as_array(value)
    if t is None:
        raise ValueError(f"{name} must be a {dtype} tensor [{batch}, N], got {type(value).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} tensor, got {t.dtype}")
    if t.ndim != 2 or t.shape[0] != batch:
        raise ValueError(f"{name} must be [{batch}, N] (one row per batch row), got {list(t.shape)}")
    if dtype == np.int64 and vocab is not None and bool(((t < -1) | (t >= vocab)).any()):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}) or -1 (padding)")
    if name == TOKEN_MASK and vocab is not None and t.shape[1] > mask_words(vocab):
        raise ValueError(f"{TOKEN_MASK} has {t.shape[1]} words per row; {vocab} tokens take {mask_words(vocab)}")
    if dtype.kind == "f" and bool(np.isnan(t).any()):
        raise ValueError(f"{name} must not contain NaN")
    return t


def sampling_inputs(batch: int, temperature=1.0, seed=None, position=None, *, vocab: int | None = None,
                    **params) -> dict[str, np.ndarray]:
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
            if out[name].ndim > 1 or (out[name].ndim == 1 and out[name].shape[0] != batch):
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
            out[name] = _table(name, value, batch, param_dtype(name), vocab)
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
                       vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """{token id: value} as ([1, slots] ids, [1, slots] values), -1 padded.
    Ids must be in [0, vocab): -1 would be taken for padding and ignored."""
    if not isinstance(bias, dict) or not all(isinstance(k, int) and not isinstance(k, bool) for k in bias):
        raise TypeError(f"logit_bias must be a dict {{token id: value}}, got {bias!r}")
    if len(bias) > slots:
        raise ValueError(f"logit_bias has {len(bias)} entries; this program takes at most {slots}")
    ids = np.full((1, slots), -1, dtype=np.int64)
    values = np.zeros((1, slots), dtype=np.float32)
    for j, (k, v) in enumerate(bias.items()):
        if not (0 <= k < (vocab if vocab is not None else 2**63)):
            raise ValueError(f"logit_bias: token id {k} is outside [0, {vocab if vocab is not None else 2**63})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
            raise ValueError(f"logit_bias[{k}] must be a number (-inf bans the token), got {v!r}")
        if not math.isinf(v) and abs(v) > FLOAT32_MAX:
            raise ValueError(f"logit_bias[{k}] = {v!r} does not fit in float32 (use inf or -inf)")
        ids[0, j], values[0, j] = k, float(v)
    return ids, values


def program_inputs(names: list[str], shapes: dict[str, tuple], given: dict[str, np.ndarray]) -> list:
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
                value = np.array(1.0, dtype=np.float32)
            else:  # off (a table: all padding)
                value = np.full(shape if table else (), BY_NAME[name].off, dtype=param_dtype(name))
        if table:
            if value.shape[1] > shape[1]:
                if name != "history":
                    raise ValueError(f"{name} has {value.shape[1]} entries per row; this program takes {shape[1]}")
                value = value[:, -shape[1]:]  # the most recent tokens
            if value.shape[1] < shape[1]:
                # ids pad with -1, bias values with 0, and a mask for fewer
                # tokens than the model has (a tokenizer's) with 0: not allowed
                fill = np.full((value.shape[0], shape[1] - value.shape[1]),
                               -1 if value.dtype == np.int64 else 0, dtype=value.dtype)
                value = np.concatenate([value, fill], axis=1)
        elif tuple(value.shape) != shape:
            if value.ndim != 0:
                raise ValueError(f"{name} must have shape {list(shape)} for this program, got {list(value.shape)}")
            value = np.broadcast_to(value, shape)  # one value for every row
        out.append(np.asarray(value, order="C"))
    return out
