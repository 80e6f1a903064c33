"""MLXPartitioner: tags the nodes our handlers can lower for MLXGraphBackend."""

from __future__ import annotations

from typing import Callable

import torch
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_partitions_from_list_of_nodes,
)
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data
from torch.export import ExportedProgram
from torch.fx.passes.operator_support import OperatorSupportBase

from .backend import MLXGraphBackend
from .lowering.builder import GraphBuilder, meta_val
from .lowering.registry import Unsupported, handler_for

# Ops whose ATen decomposition would lose a fused form we lower directly.
KEEP_WHOLE = [torch.ops.aten.linear.default]


def can_lower(node: torch.fx.Node) -> bool:
    """Runs the node's handler on a scratch builder: the support check and the
    lowering are one code path."""
    if node.op != "call_function" or handler_for(node.target) is None:
        return False
    scratch = GraphBuilder()
    try:
        for arg in node.all_input_nodes:
            val = meta_val(arg)
            if not isinstance(val, torch.Tensor):
                return False
            scratch.bind(arg, scratch.new_value(val.dtype, val.shape))
        if not isinstance(meta_val(node), torch.Tensor):
            return False
        scratch.lower_node(node)
    except (Unsupported, NotImplementedError):
        return False
    return True


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return can_lower(node)


class MLXPartitioner(Partitioner):
    """Delegates every maximal group of lowerable nodes to MLXGraphBackend.

    Nodes no handler accepts stay outside, on ExecuTorch's portable kernels.
    """

    def __init__(self) -> None:
        super().__init__()
        self.delegation_spec = DelegationSpec(MLXGraphBackend.__name__, [])

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        return KEEP_WHOLE, None

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        partitions = generate_partitions_from_list_of_nodes(
            exported_program.graph_module, op_support=_Support()
        )
        tags = {}
        for partition in partitions:
            tag = f"mlx_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        tag_constant_data(exported_program)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


__all__ = ["MLXPartitioner", "can_lower"]
