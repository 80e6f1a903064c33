"""LLMs in one program: what export writes (`export/`: the model's caches,
layer kinds, quantized weights and sampler head, traced and lowered) and
what runners run (`run/`: decode loops, drafting, chat, grammars), with the
program contract between them (`program_contract.py`, `sampler_inputs.py`).
A new layer kind touches export/ and the kernels only: runners read what a
program holds from its contract.

    from executorch_mlx.llm import ExportOptions, LLMRunner, export_llm
"""

from __future__ import annotations

# Imported on first use: `import executorch_mlx.llm.program_contract` stays light.
_PUBLIC = {"LLMRunner": ".run.runner", "export_llm": ".export.hf_export", "ExportOptions": ".export.options"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)


__all__ = list(_PUBLIC)
