"""Lowers an edge-dialect ExportedProgram (one delegate partition) to the IR."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field

import sympy
import torch
from executorch.exir._serialize._named_data_store import NamedDataStore
from torch.export import ExportedProgram

from ..custom_kernel_ops.quantized import check_activations
from ..progress import counter
from ..serialization import ir
from .common_nodes import drop_dead_nodes, merge_common_nodes
from . import weight_files
from .node_fusion import fuse_nodes
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


def symint_code(expr, symbols: dict[str, int]) -> list[int]:
    """A sympy size expression as SymIntNode's postfix code over `symbols`."""
    from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod

    Op = ir.SymIntOp
    if expr.is_Integer:
        return [int(Op.push), int(expr)]
    if expr.is_Symbol:
        if str(expr) not in symbols:
            raise Unsupported(f"size {expr} is not a dimension of a delegate input")
        return [int(Op.symbol), symbols[str(expr)]]
    ops = {sympy.Add: Op.add, sympy.Mul: Op.mul, FloorDiv: Op.floor_div, Mod: Op.mod, PythonMod: Op.mod,
           sympy.Max: Op.max, sympy.Min: Op.min, Max: Op.max, Min: Op.min}  # (torch.sym_min makes torch's own)
    op = ops.get(type(expr))
    if op is None or not expr.args:
        raise Unsupported(f"size expression {expr}")
    code = symint_code(expr.args[0], symbols)
    for arg in expr.args[1:]:  # Add/Mul/Max/Min are n-ary; the rest binary
        code += symint_code(arg, symbols) + [int(op), 0]
    return code


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
    _sym_values: dict[str, Value] = field(default_factory=dict)
    _literal_values: dict[int, object] = field(default_factory=dict)
    range_constraints: dict = field(default_factory=dict)
    # A support check on one node (the partitioner's): sizes need not resolve.
    scratch: bool = False
    # Quantized layers meet x in floats on CPUs (QuantizedLinearNode's float_activations).
    float_activations: bool = False
    # The weights go to ExecuTorch's external data file of this name (NAME.ptd), not the .pte.
    weights_file: str | None = None
    # Each slot's shape and dtype at export (sizes ints, or torch.SymInt where dynamic): node_fusion's checks.
    shapes: dict[int, tuple] = field(default_factory=dict)
    dtypes: dict[int, torch.dtype] = field(default_factory=dict)

    # ---------------------------------------------------------- slots --
    def new_value(self, dtype: torch.dtype, shape) -> Value:
        ir_dtype(dtype)  # reject unsupported dtypes early
        v = Value(ir.Tid(self.graph.num_values), dtype, tuple(shape))
        self.graph.num_values += 1
        self.shapes[v.tid.idx], self.dtypes[v.tid.idx] = v.shape, dtype
        return v

    def emit(self, op_cls, out_dtype: torch.dtype, out_shape, /, **fields) -> Value:
        """Appends one node whose single output is a new value; returns it.

        `fields` are the node's own (e.g. a=..., axes=..., dtype=...)."""
        out = self.new_value(out_dtype, out_shape)
        self.graph.nodes.append(ir.Node(op=op_cls(out=out.tid, **fields)))
        return out

    def producer(self, v: Value):
        """The IR op (of the graph's nodes) whose output is `v`, or None."""
        return next((n.op for n in reversed(self.graph.nodes) if n.op.out.idx == v.tid.idx), None)

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
            self._literal_values[v.tid.idx] = value
        return self._literals[key]

    def literal_value(self, v: Value):
        """The Python value of a literal, or None if `v` is not one."""
        return self._literal_values.get(v.tid.idx)

    def bind(self, node: torch.fx.Node, value: Value) -> None:
        self.values[node] = value

    def get(self, arg) -> Value:
        if not isinstance(arg, torch.fx.Node):
            raise Unsupported(f"expected a tensor argument, got {type(arg).__name__}")
        if arg not in self.values:
            raise Unsupported(f"{arg} was not lowered")
        v = self.values[arg]
        if not isinstance(v, Value):
            raise Unsupported(f"{arg} is not a single tensor")
        return v

    def get_upstream(self, node: torch.fx.Node) -> Value:
        """get() for a node that a fused pattern reaches past the handler's own
        inputs: a support check's scratch builder binds only those, so there
        it stands in a value of the node's dtype and shape."""
        if self.scratch and node not in self.values:
            val = meta_val(node)
            return self.new_value(val.dtype, val.shape)
        return self.get(node)

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
        if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.SymInt):
            return self.cast(self.sym_value(arg.meta["val"]), dtype)  # a size, e.g. from sym_size
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.get(arg), dtype)
        if isinstance(arg, (bool, int, float)):
            return self.literal(arg, dtype)
        raise Unsupported(f"operand of type {type(arg).__name__}")

    def size(self, d) -> ir.IntOrSlot:
        """A size argument: static, or the slot of its run-time value."""
        if isinstance(d, torch.fx.Node):
            d = meta_val(d)
        if isinstance(d, torch.SymInt) and d.node.expr.is_Integer:
            d = int(d.node.expr)
        if isinstance(d, torch.SymInt):
            return ir.IntOrSlot(value=0, slot=self.sym_value(d).tid.idx)
        return ir.IntOrSlot(value=int(d), slot=-1)

    def dims(self, shape) -> list[ir.IntOrSlot]:
        """A shape argument whose sizes may be dynamic (run-time values)."""
        return [self.size(d) for d in shape]

    def sym_value(self, d) -> Value:
        """A 0-d int64 value holding a symbolic size (or a plain int), computed
        on the host from the sizes of dynamic input dimensions."""
        expr = d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d))
        key = str(expr)
        if key not in self._sym_values:
            code = [int(ir.SymIntOp.push), 0] if self.scratch else symint_code(expr, self._symbols)
            self._sym_values[key] = self.emit(ir.SymIntNode, torch.int64, (), code=code)
        return self._sym_values[key]

    def io_dims(self, shape, output: bool = False) -> list[ir.Dim]:
        out = []
        for d in shape:
            if isinstance(d, torch.SymInt):
                name = str(d.node.expr)
                if not d.node.expr.is_Symbol and not output:
                    # an input's sizes define the symbols; outputs are resized
                    # to what the graph computes, so theirs may be expressions
                    raise Unsupported(f"derived dynamic dimension {name} at the delegate boundary")
                if name not in self._symbols:
                    r = self.range_constraints.get(d.node.expr)
                    # torch.export reports Dim(min=0 or 1) as min 2 (it
                    # specializes 0/1 while tracing) yet its programs accept
                    # 0 and 1 at run time (torch._export.utils checks the
                    # lower bound only above 2): allow what the program allows.
                    lo = int(r.lower) if r is not None and int(r.lower) > 2 else 0
                    hi = int(r.upper) if r is not None and r.upper.is_finite else 2**31 - 1
                    self._symbols[name] = len(self.graph.symbols)
                    self.graph.symbols.append(ir.Symbol(name=name, min=lo, max=hi))
                out.append(ir.Dim(size=-1, symbol=self._symbols[name]))
            else:
                out.append(ir.Dim(size=int(d), symbol=-1))
        return out

    def _store(self, tensor: torch.Tensor) -> str:
        """Puts `tensor`'s bytes in the named data store; returns their name."""
        files = weight_files.active()
        digest = files.sha256(tensor) if files is not None else None
        raw = None if digest is not None else tensor.reshape(-1).view(torch.uint8).numpy()
        digest = digest or hashlib.sha256(raw).digest()
        # Content-addressed, so identical weights are stored once.
        name = "emlx_" + digest.hex()[:32] + f"_{tensor.dtype}".replace("torch.", "")
        data = raw.tobytes() if files is None else files.data(tensor, raw, digest)
        self.named_data.add_named_data(name, data, alignment=CONSTANT_ALIGNMENT, external_tag=self.weights_file)
        return name

    def add_constant(self, node: torch.fx.Node, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        v = self.new_value(tensor.dtype, tensor.shape)
        name = self._store(tensor)
        self.graph.constants.append(
            ir.Constant(slot=v.tid.idx, name=name, dtype=ir_dtype(tensor.dtype), shape=list(tensor.shape))
        )
        self.bind(node, v)

    def add_mutable_buffer(self, node: torch.fx.Node, initial: torch.Tensor) -> Value:
        """State kept by the runtime across calls, starting as `initial`."""
        initial = initial.detach().contiguous()
        v = self.new_value(initial.dtype, initial.shape)
        buf = ir.MutableBuffer(slot=v.tid.idx, update=v.tid.idx, initial="", dtype=ir_dtype(initial.dtype),
                               shape=list(initial.shape), zero_initial=not bool(initial.any()))
        if not buf.zero_initial:
            buf.initial = self._store(initial)
        self.graph.mutable_buffers.append(buf)
        self.bind(node, v)
        return v

    def set_buffer_update(self, buffer: Value, update: Value) -> None:
        if tuple(update.shape) != tuple(buffer.shape):
            raise Unsupported(f"a buffer update changes its shape {buffer.shape} -> {update.shape}")
        for buf in self.graph.mutable_buffers:
            if buf.slot == buffer.tid.idx:
                buf.update = self.cast(update, buffer.dtype).tid.idx

    def add_input(self, node: torch.fx.Node) -> None:
        val = meta_val(node)
        if isinstance(val, torch.SymInt):  # a size computed outside the delegate
            v = self.new_value(torch.int64, ())
            self.graph.inputs.append(ir.IOValue(slot=v.tid.idx, kind=ir.IOKind.int_scalar, dtype=ir.DType.int64,
                                                shape=[]))
            self.bind(node, v)
            return
        if not isinstance(val, torch.Tensor):
            raise NotImplementedError(f"non-tensor delegate input {node.name} ({type(val).__name__})")
        v = self.new_value(val.dtype, val.shape)
        self.graph.inputs.append(ir.IOValue(slot=v.tid.idx, dtype=ir_dtype(val.dtype), shape=self.io_dims(val.shape)))
        self.bind(node, v)

    def add_output(self, arg) -> None:
        v = self.get(arg)
        self.graph.outputs.append(ir.IOValue(slot=v.tid.idx, dtype=ir_dtype(v.dtype),
                                             shape=self.io_dims(v.shape, output=True)))

    def lower_node(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:  # one output of a multi-output op
            outputs, index = self.values.get(node.args[0]), node.args[1]
            if not isinstance(outputs, list):
                raise Unsupported("getitem of a value that is not a list of outputs")
            self.bind(node, outputs[index])
            return
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


def lower_program(ep: ExportedProgram, activations: str = "int8", weights_file: str | None = None) -> GraphBuilder:
    """Lowers every node of `ep` (a partition the partitioner accepted).

    Buffers the partition mutates (a KV cache) become the program's
    MutableBuffers: the runtime owns them between calls. `activations`: see
    MLXPartitioner; `weights_file`: the constants go to ExecuTorch's external
    data file WEIGHTS_FILE.ptd instead of the .pte."""
    from torch.export.graph_signature import OutputKind

    check_activations(activations)
    b = GraphBuilder(range_constraints=dict(ep.range_constraints), float_activations=activations == "float",
                     weights_file=weights_file)
    sig = ep.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    buffer_values: dict[str, Value] = {}  # FQN -> the buffer's slot
    with counter("lowering nodes", len(ep.graph.nodes)) as count:
        for node in ep.graph.nodes:
            if node.op == "placeholder":
                fqn = sig.inputs_to_buffers.get(node.name)
                const = constant_tensor(ep, node)
                if fqn in mutated:
                    buffer_values[fqn] = b.add_mutable_buffer(node, const)
                elif const is not None and const.dim() == 0:
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
                for arg, spec in zip(node.args[0], sig.output_specs):
                    if spec.kind == OutputKind.BUFFER_MUTATION:
                        b.set_buffer_update(buffer_values[spec.target], b.get(arg))
                    else:
                        b.add_output(arg)
            count.advance()
    merge_common_nodes(b.graph)
    drop_dead_nodes(b.graph)
    fuse_nodes(b.graph, b.shapes, b.dtypes)
    return b
