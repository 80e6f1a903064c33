"""MLXGraphBackend: serializes a delegated partition to the IR blob."""

from __future__ import annotations

import contextlib
import contextvars
import copy
from typing import Callable, Iterator, final

import torch
from executorch.exir.backend.backend_details import BackendDetails, CompileSpec, PreprocessResult
from torch.export import ExportedProgram

from .serialization import ir

# (graph, blob) -> the blob to store instead; see rewrite_blobs.
BlobRewrite = Callable[[ir.Graph, bytes], bytes]
_rewrite: contextvars.ContextVar[BlobRewrite | None] = contextvars.ContextVar("emlx_blob_rewrite", default=None)


@contextlib.contextmanager
def rewrite_blobs(rewrite: BlobRewrite) -> Iterator[None]:
    """Within the block, each delegate blob this backend writes is
    `rewrite(graph, blob)`: how fuzzing and the tests build programs with
    padded or corrupt blobs (the runtime must refuse those) through the real
    export path."""
    token = _rewrite.set(rewrite)
    try:
        yield
    finally:
        _rewrite.reset(token)


@final
class MLXGraphBackend(BackendDetails):
    """The class name is the backend id the C++ runtime registers."""

    @classmethod
    def copy_exported_program_for_preprocess(cls, edge_program: ExportedProgram,
                                             compile_specs: list[CompileSpec]) -> ExportedProgram:
        """The isolated copy ExecuTorch hands to preprocess, sharing the
        weight tensors: preprocess only reads them, and ExecuTorch's default
        deep copy held a second copy of every weight during lowering."""
        tensors = (*edge_program.state_dict.values(), *edge_program.constants.values())
        memo = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
        return copy.deepcopy(edge_program, memo)

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        from .lowering.builder import lower_program

        specs = {spec.key: spec.value.decode() for spec in compile_specs}
        builder = lower_program(edge_program, **specs)
        blob = ir.serialize(builder.graph)
        rewrite = _rewrite.get()
        return PreprocessResult(
            processed_bytes=rewrite(builder.graph, blob) if rewrite is not None else blob,
            data_store_output=builder.named_data.get_named_data_store_output(),
        )
