"""Lowering a program that runs whole in our delegate, past ExecuTorch's edge passes.

`to_edge` rewrites every node into ExecuTorch's edge dialect through about
nine passes, each a retrace of the whole graph with fake tensors, so that
ExecuTorch's portable kernels could run what no delegate takes. An LLM
export lets nothing run outside our delegate (llm/export/hf_export.py
refuses such a model), so that work converted ops nobody reads. Here the
program is decomposed to core ATen once, keeping whole the ops our handlers
take whole, then delegated; ExecuTorch gets only the one-call program that
is left. Our handlers take ATen overloads, which edge ops merely wrap
(lowering/registry.py). On the test suite's tiny configs this took an
export from 21.8 s to 16.7 s (gemma3n_text) and from 14.6 s to 8.5 s
(qwen3_5_text), with the same greedy ids.
"""

from __future__ import annotations

from typing import Any

from torch.export import ExportedProgram

from .weight_files import shared_when_copied


def lower_whole(ep: ExportedProgram, partitioner, constant_methods: dict[str, Any]):
    """The EdgeProgramManager of `ep` delegated to MLX through `partitioner`,
    with `constant_methods` (the program's metadata). The caller refuses a
    program that left ops outside (`partitioner.outside`): those would be
    ATen, not edge, ops, which ExecuTorch cannot run."""
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager
    from executorch.exir.backend.backend_api import to_backend
    from executorch.exir.passes.remove_graph_asserts_pass import RemoveNonCoreAtenOpGraphAssertsPass
    from executorch.exir.program._program import _default_decomposition_table

    table = _default_decomposition_table()
    keep_whole, _ = partitioner.ops_to_not_decompose(ep)
    for op in keep_whole:
        table.pop(op, None)
    ep = ep.run_decompositions(table)
    # export's dtype/shape asserts (aten._assert_tensor_metadata): checks of
    # the traced example, with no MLX node
    RemoveNonCoreAtenOpGraphAssertsPass()(ep.graph_module)
    shared_when_copied([*ep.state_dict.values(), *ep.constants.values()])
    ep = to_backend(ep, partitioner)
    # the edge verifier checks ops of edge dialect, which this program has
    # none of outside the delegate
    return EdgeProgramManager({"forward": ep}, constant_methods, EdgeCompileConfig(_check_ir_validity=False))
