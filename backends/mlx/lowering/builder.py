"""Lowers an edge-dialect ExportedProgram (one delegate partition) to the IR."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field

import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from torch.export import ExportedProgram

from ..serialization import ir
from .registry import Unsupported, handler_for

TORCH_TO_IR = {
    torch.float32: ir.DType.float32,
    torch.float16: ir.DType.float16,
    torch.bfloat16: ir.DType.bfloat16,
    torch.int64: ir.DType.int64,
    torch.int32: ir.DType.int32,
    torch.int16: ir.DType.int16,
    torch.int8: ir.DType.int8,
    torch.uint8: ir.DType.uint8,
    torch.bool: ir.DType.bool_,
    torch.uint32: ir.DType.uint32,  # internal only: ExecuTorch tensors have no uint32
    torch.uint64: ir.DType.uint64,
}
# Weights are aligned for zero-copy use by MLX.
CONSTANT_ALIGNMENT = 64


def ir_dtype(dtype: torch.dtype) -> ir.DType:
    try:
        return TORCH_TO_IR[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype}") from None


def node_arg(node: torch.fx.Node, index: int, name: str, default=None):
    """An op argument given by position or by keyword, else `default`."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def meta_val(node: torch.fx.Node):
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        raise Unsupported(f"{node} has no example value")
    return node.meta["val"]


@dataclass
class Value:
    """A lowered value: its slot and what is known of it at export time."""

    tid: ir.Tid
    dtype: torch.dtype
    shape: tuple  # ints, or torch.SymInt for dynamic dims


@dataclass
class GraphBuilder:
    graph: ir.Graph = field(default_factory=ir.Graph)
    named_data: NamedDataStore = field(default_factory=NamedDataStore)
    values: dict[torch.fx.Node, Value] = field(default_factory=dict)
    _literals: dict[tuple, Value] = field(default_factory=dict)
    _symbols: dict[str, int] = field(default_factory=dict)
    range_constraints: dict = field(default_factory=dict)

    # ---------------------------------------------------------- slots --
    def new_value(self, dtype: torch.dtype, shape) -> Value:
        ir_dtype(dtype)  # reject unsupported dtypes early
        v = Value(ir.Tid(self.graph.num_values), dtype, tuple(shape))
        self.graph.num_values += 1
        return v

    def emit(self, op_cls, out_dtype: torch.dtype, out_shape, /, **fields) -> Value:
        """Appends one node whose single output is a new value; returns it.

        `fields` are the node's own (e.g. a=..., axes=..., dtype=...)."""
        out = self.new_value(out_dtype, out_shape)
        self.graph.nodes.append(ir.Node(op=op_cls(out=out.tid, **fields)))
        return out

    def literal(self, value, dtype: torch.dtype) -> Value:
        """A 0-d constant baked into the graph (cached per value and dtype)."""
        key = (repr(value), dtype)
        if key not in self._literals:
            v = self.new_value(dtype, ())
            lit = ir.Literal(slot=v.tid.idx, dtype=ir_dtype(dtype))
            if dtype.is_floating_point:
                lit.float_value = float(value)
            else:
                lit.int_value = int(value)
            self.graph.literals.append(lit)
            self._literals[key] = v
        return self._literals[key]

    def bind(self, node: torch.fx.Node, value: Value) -> None:
        self.values[node] = value

    def get(self, arg) -> Value:
        if not isinstance(arg, torch.fx.Node):
            raise Unsupported(f"expected a tensor argument, got {type(arg).__name__}")
        if arg not in self.values:
            raise Unsupported(f"{arg} was not lowered")
        return self.values[arg]

    # -------------------------------------------------------- helpers --
    def cast(self, v: Value, dtype: torch.dtype) -> Value:
        if v.dtype == dtype:
            return v
        return self.emit(ir.AsTypeNode, dtype, v.shape, a=v.tid, dtype=ir_dtype(dtype))

    def reshape(self, v: Value, shape) -> Value:
        """`v` viewed as the static `shape` (no node when it already has it)."""
        if tuple(v.shape) == tuple(shape):
            return v
        return self.emit(ir.ReshapeNode, v.dtype, tuple(shape), a=v.tid, shape=self.dims(shape))

    def operand(self, arg, dtype: torch.dtype) -> Value:
        """A tensor argument, lowered value or Python scalar, as a value of `dtype`."""
        if isinstance(arg, Value):
            return self.cast(arg, dtype)
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.get(arg), dtype)
        if isinstance(arg, (bool, int, float)):
            return self.literal(arg, dtype)
        raise Unsupported(f"operand of type {type(arg).__name__}")

    def dims(self, shape) -> list[ir.IntOrSlot]:
        """Static sizes for a shape argument; dynamic sizes are not lowered yet."""
        out = []
        for d in shape:
            if isinstance(d, torch.SymInt):
                raise Unsupported("a dynamic size in a shape argument (needs run-time shape values)")
            out.append(ir.IntOrSlot(value=int(d), slot=-1))
        return out

    def io_dims(self, shape) -> list[ir.Dim]:
        out = []
        for d in shape:
            if isinstance(d, torch.SymInt):
                name = str(d.node.expr)
                if not d.node.expr.is_Symbol:
                    raise Unsupported(f"derived dynamic dimension {name} at the delegate boundary")
                if name not in self._symbols:
                    r = self.range_constraints.get(d.node.expr)
                    lo = int(r.lower) if r is not None else 0
                    hi = int(r.upper) if r is not None and r.upper.is_finite else 2**31 - 1
                    self._symbols[name] = len(self.graph.symbols)
                    self.graph.symbols.append(ir.Symbol(name=name, min=lo, max=hi))
                out.append(ir.Dim(size=-1, symbol=self._symbols[name]))
            else:
                out.append(ir.Dim(size=int(d), symbol=-1))
        return out

    def add_constant(self, node: torch.fx.Node, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        v = self.new_value(tensor.dtype, tensor.shape)
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        # Content-addressed, so identical weights are stored once.
        name = "emlx_" + hashlib.sha256(data).hexdigest()[:32] + f"_{tensor.dtype}".replace("torch.", "")
        self.named_data.add_named_data(name, data, alignment=CONSTANT_ALIGNMENT)
        self.graph.constants.append(
            ir.Constant(slot=v.tid.idx, name=name, dtype=ir_dtype(tensor.dtype), shape=list(tensor.shape))
        )
        self.bind(node, v)

    def add_input(self, node: torch.fx.Node) -> None:
        val = meta_val(node)
        if not isinstance(val, torch.Tensor):
            raise NotImplementedError(f"non-tensor delegate input {node.name} ({type(val).__name__})")
        v = self.new_value(val.dtype, val.shape)
        self.graph.inputs.append(ir.IOValue(slot=v.tid.idx, dtype=ir_dtype(val.dtype), shape=self.io_dims(val.shape)))
        self.bind(node, v)

    def add_output(self, arg) -> None:
        v = self.get(arg)
        self.graph.outputs.append(ir.IOValue(slot=v.tid.idx, dtype=ir_dtype(v.dtype), shape=self.io_dims(v.shape)))

    def lower_node(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:
            raise Unsupported("multi-output ops are not lowered yet")
        handler = handler_for(node.target)
        if handler is None:
            raise Unsupported(f"no handler for {node.target}")
        handler(self, node)
        if node not in self.values:
            raise RuntimeError(f"handler for {node.target} bound no output")


def constant_tensor(ep: ExportedProgram, node: torch.fx.Node) -> torch.Tensor | None:
    """The parameter, buffer or lifted constant behind a placeholder, if any."""
    sig = ep.graph_signature
    for table in (sig.inputs_to_parameters, sig.inputs_to_buffers, sig.inputs_to_lifted_tensor_constants):
        if node.name in table:
            fqn = table[node.name]
            return ep.state_dict[fqn] if fqn in ep.state_dict else ep.constants[fqn]
    return None


def lower_program(ep: ExportedProgram) -> GraphBuilder:
    """Lowers every node of `ep` (a partition the partitioner accepted)."""
    if ep.graph_signature.buffers_to_mutate:
        raise NotImplementedError("mutable buffers (e.g. a KV cache) are not lowered yet")
    b = GraphBuilder(range_constraints=dict(ep.range_constraints))
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            const = constant_tensor(ep, node)
            if const is not None and const.dim() == 0:
                b.bind(node, b.literal(const.item(), const.dtype))  # a lifted Python scalar
            elif const is not None:
                b.add_constant(node, const)
            else:
                b.add_input(node)
        elif node.op == "call_function":
            try:
                b.lower_node(node)
            except Unsupported as e:
                raise RuntimeError(f"cannot lower {node.format_node()}: {e}") from e
        elif node.op == "output":
            for arg in node.args[0]:
                b.add_output(arg)
    return b
