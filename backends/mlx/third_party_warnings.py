"""Known warnings of our dependencies that a command-line user can do nothing
about, hidden so that the CLI's own lines stand out (`--verbose` keeps them).

Each filter names the warning's category (or logger), the module that raises
it and its message, so an unknown warning, or any of ours, still shows."""

from __future__ import annotations

import logging
import os
import re
import warnings

# (category, module that raises it, message): Python warnings
PYTHON_WARNINGS = [
    # torch's own pytree code, pickled/deep-copied through copyreg
    (FutureWarning, r"copyreg$", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (FutureWarning, r"torch\.", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

# (logger, message): records of the `logging` module
LOG_RECORDS = [
    # torchao registers its Enums with torch's pytree when it is imported
    ("torch.utils._pytree", r".* is an Enum subclass .*register_constant\(\) on Enum subclasses is deprecated"),
    # torchao's optional CUDA/MX kernels, absent from a CPU install
    ("torchao", r"Failed to load \S*torchao/_C\S*\.so"),
    # state layers' kernels run once eagerly at export (llm/export/state_cache.py); the program runs ours
    ("transformers.integrations.hub_kernels", r"`\S+` is falling back to its reference PyTorch implementation"),
]


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern, re.S)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and self.pattern.match(record.getMessage()))


def hide_import_noise() -> None:
    """Drops the LOG_RECORDS, logged when ExecuTorch's export stack is first
    imported (whenever that is): the package installs this on import."""
    for name, message in LOG_RECORDS:
        logger = logging.getLogger(name)
        # a logger's own filters see only the records logged on it, not its children's
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == message for f in logger.filters):
            logger.addFilter(_DropMatching(message))


def hide_known_warnings() -> None:
    """Installs the filters for this process (the CLI's). Call before torch is
    imported: some of these are emitted on import."""
    for category, module, message in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    hide_import_noise()
    # transformers' "Loading weights" bar: our export reports its own stages
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
