"""Module globals of transformers' modeling code swapped while a model is
traced: a layer's own code then calls our function where it calls one of its
module's functions by name (its kernels, its rotary embedding), with no copy
of the layer's code here."""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable


@contextlib.contextmanager
def swapped(model, replacements: dict[str, Callable], modules: tuple[str, ...] | None = None):
    """Within the block, every modeling module of `model`'s submodules (or
    only those named in `modules`) that defines a global of `replacements`
    has it replaced; restored on exit."""
    found = {inspect.getmodule(type(m)) for m in model.modules()}
    saved = []
    for module in found:
        if module is None or (modules is not None and module.__name__ not in modules):
            continue
        for name, replacement in replacements.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """`owner.name` (a module's global, a class's attribute) is `value` within
    the block; restored on exit."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
