"""Sizes as export records them: ints, or torch.SymInt where dynamic."""

from __future__ import annotations


def same_size(a, b) -> bool:
    """Two sizes known to be equal: equal ints, or the same symbol."""
    return str(a) == str(b)


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))
