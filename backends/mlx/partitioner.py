"""MLXPartitioner: tags the nodes our handlers can lower for MLXGraphBackend."""

from __future__ import annotations

import operator
from typing import Callable

import torch
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_partitions_from_list_of_nodes,
)
from executorch.exir.backend.backend_details import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from torch.export import ExportedProgram
from torch.fx.passes.operator_support import OperatorSupportBase

from .backend import MLXGraphBackend
from .custom_kernel_ops.quantized import check_activations
from .lowering.builder import GraphBuilder, meta_val
from .lowering.registry import Unsupported, aten_op, handler_for

# Ops whose ATen decomposition would lose a fused form we lower directly.
KEEP_WHOLE = [torch.ops.aten.linear.default, torch.ops.aten.scaled_dot_product_attention.default,
              torch.ops.aten.silu.default]


def _scratch_value(b: GraphBuilder, val):
    """A stand-in for an argument's example value on a scratch builder:
    a Value per tensor, None for a symbolic size (handlers read sizes from
    node metadata)."""
    if isinstance(val, torch.Tensor):
        return b.new_value(val.dtype, val.shape)
    if isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val):
        return [b.new_value(v.dtype, v.shape) for v in val]
    if isinstance(val, torch.SymInt):
        return None
    raise Unsupported(f"argument of type {type(val).__name__}")


def _lowerable_output(val) -> bool:
    if isinstance(val, (list, tuple)):
        return all(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, (torch.Tensor, torch.SymInt))


def why_not_lowered(node: torch.fx.Node) -> str | None:
    """Why the node cannot be lowered, or None when it can. Runs the node's
    handler on a scratch builder: the support check and the lowering are
    one code path."""
    if node.op != "call_function":
        return "not a call"
    if node.target is operator.getitem:  # an output of a multi-output op we lower
        if not isinstance(node.args[0], torch.fx.Node):
            return "an item of a non-node"
        return why_not_lowered(node.args[0])
    if handler_for(node.target) is None:
        return "no MLX handler for this op"
    scratch = GraphBuilder(scratch=True)
    try:
        for arg in node.all_input_nodes:
            value = _scratch_value(scratch, meta_val(arg))
            if value is not None:
                scratch.bind(arg, value)
        if not _lowerable_output(meta_val(node)):
            return "its output is not a tensor"
        scratch.lower_node(node)
    except (Unsupported, NotImplementedError) as e:
        return str(e) or type(e).__name__
    return None


def can_lower(node: torch.fx.Node) -> bool:
    return why_not_lowered(node) is None


def untag_shared_sizes(ep: ExportedProgram) -> None:
    """A size (sym_size) used outside its partition stays with ExecuTorch: a
    delegate cannot return a SymInt, but it can take one as an input."""
    for node in ep.graph.nodes:
        tag = node.meta.get("delegation_tag")
        if tag and isinstance(node.meta.get("val"), torch.SymInt):
            if any(user.meta.get("delegation_tag") != tag for user in node.users):
                del node.meta["delegation_tag"]


def tag_owned_buffers(ep: ExportedProgram) -> None:
    """Gives each mutated buffer (a KV cache) to the partition that reads it
    and computes its new value, when that is one partition: the runtime then
    keeps it between calls and nothing of it crosses to the host. A buffer
    split across partitions stays with ExecuTorch (correct, but copied)."""
    from torch.export.graph_signature import OutputKind

    sig = ep.graph_signature
    producers = {spec.target: spec.arg.name for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
    nodes = {n.name: n for n in ep.graph.nodes}
    for node in ep.graph.nodes:
        fqn = sig.inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        if fqn not in producers:
            continue
        tags = {user.meta.get("delegation_tag") for user in node.users}
        tags.add(nodes[producers[fqn]].meta.get("delegation_tag"))
        if len(tags) == 1 and None not in tags:
            node.meta["delegation_tag"] = tags.pop()


# Why partition() kept a lowerable node outside all the same.
SIZE_OUTSIDE = "a size used outside the delegate (sizes stay with ExecuTorch)"
DERIVED_SIZE_INPUT = ("reads a tensor whose size is an expression of the dynamic sizes (like 2*s) from outside "
                      "the delegate (a delegate's input sizes must be the program's own)")


class _Support(OperatorSupportBase):
    def __init__(self, excluded: set[torch.fx.Node] = frozenset()):
        super().__init__()
        self.excluded = excluded

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node in self.excluded or (node.target is operator.getitem and node.args[0] in self.excluded):
            return False
        return can_lower(node)


def _reads_derived_sizes(partitions) -> set[torch.fx.Node]:
    """Nodes that read, from outside their partition, a tensor sized by an
    expression such as 2*s: the delegate could not define that size from its
    inputs, so such a node stays outside (and the partitions are redrawn)."""
    found = set()
    for partition in partitions:
        for node in partition.nodes:
            for arg in node.all_input_nodes:
                val = arg.meta.get("val")
                if arg not in partition.nodes and isinstance(val, torch.Tensor) and any(
                        isinstance(d, torch.SymInt) and not d.node.expr.is_Symbol for d in val.shape):
                    found.add(node)
    return found


class MLXPartitioner(Partitioner):
    """Delegates every maximal group of lowerable nodes to MLXGraphBackend.

    Nodes no handler accepts stay outside, on ExecuTorch's portable kernels.
    `activations` (one of ACTIVATIONS, custom_kernel_ops/quantized.py): how
    4- and 8-bit layers meet x in our CPU kernel. `weights_file`: the
    weights go to ExecuTorch's external data file WEIGHTS_FILE.ptd (written
    by the program manager's write_tensor_data_to_file) instead of the .pte.
    """

    def __init__(self, activations: str = "int8", weights_file: str | None = None) -> None:
        super().__init__()
        check_activations(activations)
        # the backend's lower_program keywords, as compile specs
        specs = {"activations": activations, **({"weights_file": weights_file} if weights_file else {})}
        self.delegation_spec = DelegationSpec(MLXGraphBackend.__name__,
                                              [CompileSpec(k, v.encode()) for k, v in specs.items()])
        # What the last partition() left to ExecuTorch: (op, why), one per op and
        # reason, and the module the first such node came from.
        self.outside: list[tuple[str, str]] = []
        self.outside_modules: dict[tuple[str, str], str] = {}

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        # An op stays whole only if we lower every use of it: the rest
        # decomposes for ExecuTorch's kernels (which have no fused attention).
        # (A per-node filter here breaks transformers' attention export.)
        used = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in KEEP_WHOLE]
        return [op for op in KEEP_WHOLE if all(can_lower(n) for n in used if n.target == op)], None

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        excluded: set[torch.fx.Node] = set()
        while True:
            partitions = generate_partitions_from_list_of_nodes(
                exported_program.graph_module, op_support=_Support(excluded)
            )
            derived = _reads_derived_sizes(partitions)
            if not derived:
                break
            excluded |= derived
        tags = {}
        for partition in partitions:
            tag = f"mlx_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        untag_shared_sizes(exported_program)
        tag_constant_data(exported_program)
        tag_owned_buffers(exported_program)
        self.outside_modules = _outside(exported_program, excluded)
        self.outside = list(self.outside_modules)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _outside(ep: ExportedProgram, excluded: set[torch.fx.Node] = frozenset()) -> dict[tuple[str, str], str]:
    """(op, reason) of every compute node left outside the delegates -> the
    module its first node came from ('' when torch.export did not say)."""
    found = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.meta.get("delegation_tag") or node.target is operator.getitem:
            continue
        reason = DERIVED_SIZE_INPUT if node in excluded else why_not_lowered(node)
        if reason is None:  # lowerable, but its size is needed outside its partition
            reason = SIZE_OUTSIDE
        op = aten_op(node.target)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        found.setdefault((str(op) if op is not None else getattr(node.target, "__name__", str(node.target)),
                          reason), stack[-1][0] if stack else "")
    return found


__all__ = ["MLXPartitioner", "SIZE_OUTSIDE", "can_lower", "why_not_lowered"]
