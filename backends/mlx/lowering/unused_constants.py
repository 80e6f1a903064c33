"""Weights left behind outside the delegate.

After lowering, the top-level program keeps a placeholder for every buffer
the model registered, even when nothing reads it any more: our delegate
holds its own copy of each weight it uses, and ExecuTorch drops only unused
*parameters* (`remove_unused_parameters_pass`), not buffers. A quantized
table is a buffer, so a tied embedding/head table was written twice (the
~104M int4 model: 81.6 MiB instead of 62 MiB), and loaded twice; so was any
unused buffer (transformers' `original_inv_freq`).
"""

from __future__ import annotations

from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind

_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def drop_unused_constants(ep: ExportedProgram) -> list[str]:
    """Removes from `ep` (in place) every parameter, buffer and constant
    tensor that no node reads and no node mutates; returns their names."""
    mutated = {s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    kept, dropped = [], []
    for spec in ep.graph_signature.input_specs:
        node = placeholders.get(spec.arg.name)
        if spec.kind in _CONSTANT_KINDS and node is not None and not node.users and spec.target not in mutated:
            ep.graph_module.graph.erase_node(node)
            ep.state_dict.pop(spec.target, None)
            ep.constants.pop(spec.target, None)
            dropped.append(spec.target)
        else:
            kept.append(spec)
    if dropped:
        ep._graph_signature = ExportGraphSignature(kept, ep.graph_signature.output_specs)
        ep.graph_module.recompile()
    return dropped
