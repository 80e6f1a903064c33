"""The handler registry: one table serves both support checks and lowering.

A handler lowers one fx node into IR nodes through a GraphBuilder. It raises
`Unsupported` for any variant it cannot lower (an argument value, a dtype);
the partitioner asks "is this node supported?" by running the same handler
on a scratch builder, so "supported" and "lowered" cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from .builder import GraphBuilder

Handler = Callable[["GraphBuilder", torch.fx.Node], None]

_HANDLERS: dict[Callable, Handler] = {}  # OpOverloads, and Python operators on sizes


class Unsupported(Exception):
    """This node (or this variant of it) cannot be lowered to MLX."""


def handles(*ops: Callable) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op in ops:
            if op in _HANDLERS:
                raise ValueError(f"two handlers for {op}")
            _HANDLERS[op] = fn
        return fn

    return register


def aten_op(target) -> torch._ops.OpOverload | None:
    """The ATen/custom overload behind an fx target (edge ops wrap one).

    A plain OpOverload also has an `_op` (its C++ builtin): only unwrap others."""
    if isinstance(target, torch._ops.OpOverload):
        return target
    op = getattr(target, "_op", None)
    return op if isinstance(op, torch._ops.OpOverload) else None


def handler_for(target) -> Handler | None:
    """The handler of an ATen/custom op, or of a Python operator on sizes."""
    _load_handlers()
    op = aten_op(target)
    return _HANDLERS.get(op if op is not None else target)


def registered_ops() -> list[torch._ops.OpOverload]:
    _load_handlers()
    return [op for op in _HANDLERS if isinstance(op, torch._ops.OpOverload)]


def _load_handlers() -> None:
    # Importing the op-family modules registers their handlers.
    from . import (  # noqa: F401
        ops_attention,
        ops_creation,
        ops_elementwise,
        ops_experts,
        ops_linalg,
        ops_quantized,
        ops_reduction,
        ops_sampling,
        ops_shape,
        ops_state,
    )
