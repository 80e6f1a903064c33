"""executorch-mlx: an ExecuTorch backend that lowers PyTorch programs to an
MLX graph IR and runs them with MLX, token sampling included.

Importing the package loads the runtime plugin, so ExecuTorch's Python
runtime (`executorch.runtime.Runtime`) lists and runs BACKEND_ID.
"""

import logging as _logging
from contextlib import contextmanager as _contextmanager


@_contextmanager
def _quiet(*names):
    """ExecuTorch's import pulls in torchao, which logs warnings about optional
    CUDA extensions on every import; hide just those loggers meanwhile."""
    loggers = [_logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(_logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


with _quiet("torchao", "torch.utils._pytree"):
    from ._runtime_library import load as _load_runtime
    from ._runtime_library import last_error, memory_budget, reset_state, runner_binary, set_memory_budget
    from .backend import MLXGraphBackend
    from .custom_kernel_ops import quantized as _quantized_ops  # registers torch.ops.mlx.quantized_*
    from .custom_kernel_ops import sample as _sample_op  # registers torch.ops.mlx.sample
    from .partitioner import MLXPartitioner

    _load_runtime()

BACKEND_ID = MLXGraphBackend.__name__

__all__ = ["BACKEND_ID", "MLXGraphBackend", "MLXPartitioner", "last_error", "memory_budget", "reset_state",
           "runner_binary", "set_memory_budget"]
