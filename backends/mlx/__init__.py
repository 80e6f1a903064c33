"""executorch-mlx: an ExecuTorch backend that lowers PyTorch programs to an
MLX graph IR and runs them with MLX, token sampling included.

Importing the package loads the runtime plugin, so ExecuTorch's Python
runtime (`executorch.runtime.Runtime`) lists and runs BACKEND_ID.
"""

from ._runtime_library import load as _load_runtime
from .backend import MLXGraphBackend
from .custom_kernel_ops import sample as _sample_op  # registers torch.ops.mlx.sample
from .partitioner import MLXPartitioner

BACKEND_ID = MLXGraphBackend.__name__

_load_runtime()

__all__ = ["BACKEND_ID", "MLXGraphBackend", "MLXPartitioner"]
