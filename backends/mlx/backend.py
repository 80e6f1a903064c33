"""MLXGraphBackend: serializes a delegated partition to the IR blob."""

from __future__ import annotations

from typing import final

from executorch.exir.backend.backend_details import BackendDetails, CompileSpec, PreprocessResult
from torch.export import ExportedProgram

from .serialization import ir


@final
class MLXGraphBackend(BackendDetails):
    """The class name is the backend id the C++ runtime registers."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        from .lowering.builder import lower_program

        builder = lower_program(edge_program)
        return PreprocessResult(
            processed_bytes=ir.serialize(builder.graph),
            data_store_output=builder.named_data.get_named_data_store_output(),
        )
