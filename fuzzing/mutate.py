"""Field-aware mutations of IR graphs.

`mutations(graph)` lists every single-field change worth trying: each field
of each node (and of the graph: inputs, outputs, literals, buffers, symbols,
counts) set to the boundary values of its wire type (0, -1, huge, int32 and
int64 extremes, NaN/inf, out-of-range enums, ids of other, missing or
out-of-range value slots), and each list emptied, cut or grown. Driven by
the schema (`ir.FIELD_TYPES`), so a new node type is covered without code.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import random
from dataclasses import dataclass
from typing import Any

from executorch_mlx.serialization import ir

INT32 = [0, -1, 1, 2, 3, 2**16, -(2**16), 2**31 - 1, -(2**31)]
UINT32 = [0, 1, 2, 2**16, 2**24, 2**31, 2**32 - 1]
INT64 = [0, -1, 1, 3, 2**31 - 1, 2**31, 2**32 + 5, 2**62, 2**63 - 1, -(2**63)]
FLOAT32 = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 3.4e38, 1e-45, 2.0**31]
DOUBLE = FLOAT32 + [1e308, -1e308, 5e-324]
ENUM8 = [11, 99, 127, -1, -128]  # int8 values outside every enum of the schema
SCALARS = {"Int": INT32, "UInt": UINT32, "Long": INT64, "Float": FLOAT32, "Double": DOUBLE, "Short": [0, -1, 32767],
           "Byte": [0, -1, 127, -128], "UByte": [0, 1, 255]}
ENUMS = {name: cls for name, cls in vars(ir).items() if isinstance(cls, type) and issubclass(cls, enum.IntEnum)}
DROP, EMPTY, DUPLICATE = "drop", "empty", "duplicate"  # list edits


@dataclass(frozen=True)
class Mutation:
    path: tuple  # attribute names and list indices from the graph root
    value: Any  # the new value, or (DROP | EMPTY | DUPLICATE, index) for a list

    def describe(self) -> str:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path).lstrip(".")
        if isinstance(self.value, tuple) and self.value and self.value[0] in (DROP, EMPTY, DUPLICATE):
            return f"{where}: {self.value[0]} {self.value[1] if self.value[0] != EMPTY else ''}".rstrip()
        return f"{where} = {self.value!r}"


def _kind(type_name: str) -> tuple[str, bool]:
    base = type_name.split()[0]
    return (base[1:-1], True) if base.startswith("[") else (base, False)


def _tid_choices(graph: ir.Graph, current) -> list:
    n = graph.num_values
    picks = {None, ir.Tid(0), ir.Tid(2), ir.Tid(max(n - 1, 0)), ir.Tid(n), ir.Tid(2**32 - 1)}
    picks.discard(current)
    return sorted(picks, key=lambda t: -1 if t is None else t.idx)


def _scalar_choices(kind: str, current) -> list:
    if kind == "Bool":
        return [not current]
    if kind in ENUMS:
        return [v for v in [*map(int, ENUMS[kind]), *ENUM8] if v != int(current)]
    if kind == "String":
        return ["", "x" * 300, "\u00e9\u0000"]
    return [v for v in SCALARS[kind] if not (v == current and type(v) is type(current))]


def mutations(graph: ir.Graph) -> list[Mutation]:
    out: list[Mutation] = []
    _walk(graph, graph, (), out)
    return out


def _walk(graph: ir.Graph, obj, path: tuple, out: list[Mutation]) -> None:
    for name, type_name in ir.FIELD_TYPES[type(obj).__name__].items():
        value, p = getattr(obj, name), path + (name,)
        kind, is_list = _kind(type_name)
        if is_list:
            items = value or []
            if items:
                out += [Mutation(p, (EMPTY, 0)), Mutation(p, (DROP, len(items) - 1)), Mutation(p, (DUPLICATE, 0))]
            for k, item in enumerate(items):
                _value(graph, kind, item, p + (k,), out, in_list=True)
            if kind in SCALARS:
                out += [Mutation(p + (len(items),), v) for v in (SCALARS[kind][-1], -1)]  # appended
        else:
            _value(graph, kind, value, p, out)


def _value(graph: ir.Graph, kind: str, value, path: tuple, out: list[Mutation], in_list: bool = False) -> None:
    if kind == "Tid":  # (a list cannot hold a missing one)
        out += [Mutation(path, t) for t in _tid_choices(graph, value) if t is not None or not in_list]
    elif kind == "Union":  # a node's op: removed, or its fields
        out.append(Mutation(path, None))
        _walk(graph, value, path, out)
    elif kind in ir.FIELD_TYPES:  # a table or struct: its own fields
        if value is None:
            return
        _walk(graph, value, path, out)
    else:
        out += [Mutation(path, v) for v in _scalar_choices(kind, value)]


def apply(graph: ir.Graph, *changes: Mutation) -> ir.Graph:
    """A mutated copy of `graph`. A change whose path an earlier change
    removed (a dropped node, a cleared list) is skipped."""
    g = copy.deepcopy(graph)
    for m in changes:
        try:
            g = _set(g, m.path, m.value)
        except (AttributeError, IndexError):
            continue
    return g


def _set(obj, path: tuple, value):
    """`obj` with the element at `path` replaced (structs are frozen: rebuilt)."""
    head, rest = path[0], path[1:]
    if isinstance(head, int):  # obj is a list
        items = list(obj)
        if rest:
            items[head] = _set(items[head], rest, value)
        elif head >= len(items):
            items.append(value)
        else:
            items[head] = value
        return items
    current = getattr(obj, head)
    if not rest and isinstance(value, tuple) and value and value[0] in (DROP, EMPTY, DUPLICATE):
        edit, k = value
        items = list(current)
        new = [] if edit == EMPTY else items[:k] + items[k + 1:] if edit == DROP else items + [copy.deepcopy(items[k])]
        return _replace(obj, head, new)
    return _replace(obj, head, _set(current, rest, value) if rest else value)


def _replace(obj, name: str, value):
    if dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen:
        return dataclasses.replace(obj, **{name: value})
    setattr(obj, name, value)
    return obj


def sample(graph: ir.Graph, rng: random.Random, count: int, max_changes: int = 1) -> list[list[Mutation]]:
    """`count` draws of 1..max_changes mutations, three in four of a node's
    fields (the rest of the graph's: inputs, literals, counts). Within each
    group no mutation repeats before all were drawn."""
    pool = mutations(graph)
    groups = [[m for m in pool if m.path[0] == "nodes"], [m for m in pool if m.path[0] != "nodes"]]
    orders = [rng.sample(g, len(g)) for g in groups]
    drawn = [0, 0]  # from each group so far
    picks = []
    for i in range(count):
        g = 1 if i % 4 == 3 and orders[1] else 0
        first = orders[g][drawn[g] % len(orders[g])]
        drawn[g] += 1
        extra = [rng.choice(pool) for _ in range(rng.randint(0, max_changes - 1))]
        picks.append([first, *extra])
    return picks
