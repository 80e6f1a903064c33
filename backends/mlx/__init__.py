"""executorch-mlx: an ExecuTorch backend that lowers PyTorch programs to an
MLX graph IR and runs them with MLX, token sampling included.

Importing the package loads the runtime plugin, so ExecuTorch's Python
runtime (`executorch.runtime.Runtime`) lists and runs BACKEND_ID. It imports
neither torch nor ExecuTorch's export stack, seconds that running a program
does not need (our runners load programs through loaded_program.py). The
export side (MLXPartitioner, MLXGraphBackend, llm.export) is imported on
first use and registers our torch ops (`torch.ops.mlx.*`, custom_kernel_ops).
"""

from .third_party_warnings import hide_import_noise as _hide_import_noise

_hide_import_noise()

from ._runtime_library import last_error, memory_budget, reset_state, runner_binary, set_memory_budget  # noqa: E402
from ._runtime_library import load as _load_runtime  # noqa: E402
from ._executorch_runtime import install as _install_runtime_hook  # noqa: E402

_install_runtime_hook()  # ExecuTorch's own Python runtime, imported later, skips its export stack

# The id the runtime registered; MLXGraphBackend carries the same name.
BACKEND_ID = _load_runtime().emlx_backend_id().decode()

_EXPORT_SIDE = {"MLXGraphBackend": ".backend", "MLXPartitioner": ".partitioner"}


def __getattr__(name: str):
    if name not in _EXPORT_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORT_SIDE[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["BACKEND_ID", "MLXGraphBackend", "MLXPartitioner", "last_error", "memory_budget", "reset_state",
           "runner_binary", "set_memory_budget"]
