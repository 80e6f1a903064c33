"""Our torch.library ops (`torch.ops.mlx.*`), each with its CPU reference and
its fake: what export traces and lowers. Importing this package registers
them all; the export side (llm.export, lowering, the partitioner) does, and
running a program never needs them."""

from . import attention, experts, quantized, sample, state, verification  # noqa: F401
