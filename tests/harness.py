"""Shared test helpers: lower a module with our partitioner, inspect what was
delegated, and run the .pte through ExecuTorch's Python runtime."""

from __future__ import annotations

import torch
from executorch.exir import EdgeProgramManager, to_edge_transform_and_lower
from executorch.runtime import Runtime

import executorch_mlx
from executorch_mlx.inspector import undelegated_ops  # noqa: F401  (re-exported for the tests)
from executorch_mlx.serialization import ir

def lower(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, strict: bool = False,
          dynamic_shapes=None, activations: str = "int8") -> EdgeProgramManager:
    ep = torch.export.export(module, args, kwargs or {}, strict=strict, dynamic_shapes=dynamic_shapes)
    return to_edge_transform_and_lower(ep, partitioner=[executorch_mlx.MLXPartitioner(activations)])


def delegate_graphs(edge: EdgeProgramManager) -> list[ir.Graph]:
    """The IR graph of every delegate of the program's forward method."""
    gm = edge.exported_program().graph_module
    graphs = []
    for _, mod in gm.named_children():
        if getattr(mod, "backend_id", None) == executorch_mlx.BACKEND_ID:
            graphs.append(ir.deserialize(mod.processed_bytes))
    return graphs


def node_types(edge: EdgeProgramManager) -> set[str]:
    return {type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes}


def without_fusion(monkeypatch, fuse) -> None:
    """Lowers without one pass of lowering/node_fusion.py (`fuse`, its
    function) for the rest of the test: the unfused program to compare with."""
    from executorch_mlx.lowering import node_fusion

    monkeypatch.setattr(node_fusion, "_PASSES", [p for p in node_fusion._PASSES if p[1] is not fuse])


def run(buffer: bytes, inputs: list, method: str = "forward") -> list[torch.Tensor]:
    program = Runtime.get().load_program(buffer)
    return list(program.load_method(method).execute(inputs))


def lower_and_run(module, args: tuple, **kw) -> tuple[EdgeProgramManager, list[torch.Tensor]]:
    edge = lower(module, args, **kw)
    outs = run(edge.to_executorch().buffer, list(args))
    return edge, outs


TOLERANCE = {  # (atol, rtol) against eager PyTorch on the same inputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_matches_eager(module, args: tuple, *, expect_nodes: set[str] = frozenset(), **kw) -> None:
    """Lowers `module`, checks that nothing ran outside our delegate (and that
    the IR has `expect_nodes`), runs the .pte and compares with eager."""
    edge = lower(module, args, **kw)
    assert undelegated_ops(edge) == [], f"not delegated: {undelegated_ops(edge)}"
    missing = set(expect_nodes) - node_types(edge)
    assert not missing, f"IR lacks {missing}; has {node_types(edge)}"
    got = run(edge.to_executorch().buffer, list(args))
    want = module(*args)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.is_floating_point:
            atol, rtol = TOLERANCE[w.dtype]
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True)
        else:
            assert torch.equal(g, w), (g, w)
