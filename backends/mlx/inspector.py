"""Readable dumps of IR blobs and of the MLX delegates inside a .pte file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .serialization import ir


def _dims(dims: list[ir.Dim], symbols: list[ir.Symbol]) -> str:
    parts = [str(d.size) if d.symbol < 0 else symbols[d.symbol].name for d in dims]
    return "[" + ", ".join(parts) + "]"


def _field(value) -> str:
    if isinstance(value, ir.Tid):
        return f"%{value.idx}"
    if isinstance(value, ir.IntOrSlot):
        return str(value.value) if value.slot < 0 else f"%{value.slot}"
    if isinstance(value, list):
        return "[" + ", ".join(_field(v) for v in value) + "]"
    if isinstance(value, ir.DType):
        return value.name
    return repr(value)


def describe_node(node) -> str:
    fields = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    out = fields.pop("out", None)
    args = ", ".join(f"{k}={_field(v)}" for k, v in fields.items() if v is not None)
    lhs = f"{_field(out)} = " if out is not None else ""
    return f"{lhs}{type(node).__name__}({args})"


def describe_graph(g: ir.Graph) -> str:
    lines = [f"schema v{g.version}, {g.num_values} values, {len(g.nodes)} nodes"]
    for s in g.symbols:
        lines.append(f"  symbol {s.name} in [{s.min}, {s.max}]")
    for label, ios in (("input", g.inputs), ("output", g.outputs)):
        for io in ios:
            lines.append(f"  {label} %{io.slot}: {io.dtype.name}{_dims(io.shape, g.symbols)}")
    for c in g.constants:
        lines.append(f"  constant %{c.slot}: {c.dtype.name}{list(c.shape)} '{c.name}'")
    for lit in g.literals:
        value = lit.float_value if lit.dtype.name.startswith(("float", "bfloat")) else lit.int_value
        lines.append(f"  literal %{lit.slot}: {lit.dtype.name} = {value}")
    for b in g.mutable_buffers:
        lines.append(f"  mutable buffer %{b.slot} (initial '{b.initial}', updated from %{b.update})")
    for i, n in enumerate(g.nodes):
        lines.append(f"  {i:4d}: {describe_node(n.op)}")
    return "\n".join(lines)


def _read_program(pte: bytes):
    """The .pte's Program table, parsed by ExecuTorch's serializer."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    return deserialize_pte_binary(pte).program


def delegate_blobs(pte: bytes) -> list[tuple[str, int, str, bytes]]:
    """(method, delegate index, backend id, processed bytes) for every delegate."""
    return _blobs(_read_program(pte))


def _blobs(program) -> list[tuple[str, int, str, bytes]]:
    found = []
    for plan in program.execution_plan:
        for i, d in enumerate(plan.delegates):
            data = program.backend_delegate_data[d.processed.index].data
            found.append((plan.name, i, d.id, bytes(data)))
    return found


def delegate_graphs(pte: bytes) -> list[ir.Graph]:
    """The IR graph of every MLXGraphBackend delegate in a .pte."""
    from . import BACKEND_ID

    return [ir.deserialize(blob) for _, _, backend_id, blob in delegate_blobs(pte) if backend_id == BACKEND_ID]


# Call nodes around a delegate that are plumbing, not computation.
_PLUMBING = {"executorch_call_delegate", "getitem"}


def undelegated_ops(edge) -> list[str]:
    """The compute ops an EdgeProgramManager left outside every delegate
    (they run on ExecuTorch's portable kernels)."""
    gm = edge.exported_program().graph_module
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") not in _PLUMBING]


def check_identifier(head: bytes, name) -> None:
    """ValueError unless `head` (a file's first bytes) holds ExecuTorch's file
    identifier: checked before ExecuTorch sees a file, as it logs a wrong
    identifier as text and its Python logging aborts the process on bytes
    that are not UTF-8."""
    if len(head) < 8 or head[4:6] != b"ET" or not head[6:8].isdigit():
        raise ValueError(f"{name} is not an ExecuTorch program (no ET.. file identifier at bytes 4-8)")


def inspect_pte(path: str | Path) -> str:
    """A readable dump of the .pte's MLX delegates. A file that is not a
    readable .pte is a ValueError naming it (the parsers below raise whatever
    a corrupt buffer makes them: struct.error, TypeError, IndexError...)."""
    from . import BACKEND_ID
    from ._runtime_library import check_program

    data = Path(path).read_bytes()
    check_identifier(data[:8], path)
    try:
        check_program(data)  # our container checks: quick, and no export stack to import for a bad file
        program = _read_program(data)
        blobs = _blobs(program)
    except Exception as e:  # noqa: BLE001 - any parser failure means a corrupt file
        raise ValueError(f"{path} is not a readable .pte (corrupt or truncated): {type(e).__name__}: {e}") from None
    lines = []
    for method, i, backend_id, blob in blobs:
        if backend_id != BACKEND_ID:
            lines.append(f"method {method}, delegate {i}: {backend_id} (not ours, {len(blob)} bytes)")
            continue
        lines.append(f"method {method}, delegate {i}: {backend_id}, {len(blob)} bytes")
        try:
            lines.append(describe_graph(ir.deserialize(blob)))
        except Exception as e:  # noqa: BLE001 - a corrupt blob: said, and the others still shown
            lines.append(f"  (this delegate's graph cannot be read: {type(e).__name__}: {e})")
    if not blobs:
        lines.append("no delegates: the whole program runs on ExecuTorch's portable kernels")
    lines += _outside_lines(program)
    return "\n".join(lines)


def _outside_lines(program) -> list[str]:
    """The operators each method runs outside the delegates, and why. The
    .pte keeps only their names: an op with no handler says so; one whose
    handler refused this use (a dtype, an argument) was reported by export,
    with the partitioner's reason (MLXPartitioner.outside)."""
    from .lowering.registry import registered_ops

    handled = {str(op).rsplit(".", 1)[0] for op in registered_ops()}  # "aten.add"
    lines = []
    for plan in program.execution_plan:
        for op in plan.operators:
            why = ("an MLX handler refused this use; export printed why" if op.name.replace("::", ".") in handled
                   else "no MLX handler for this op")
            lines.append(f"method {plan.name} runs outside the delegates: {op.name}.{op.overload} ({why})")
    return lines
