"""ExecuTorch's Python runtime without its export stack.

ExecuTorch's pybindings (`portable_lib`) import `executorch.exir`, the whole
export stack with torchao (about 8 s on a 2-core machine), for one warning
class, and its ScalarType table lives in the same package. Running a program
needs neither: we load those two leaf modules from their files, so importing
this package or `executorch-mlx generate` starts in about 2.5 s, not 10.
`executorch.exir` itself stays unimported, for whoever exports to import for
real; once it is imported, everything here takes the ordinary path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PYBINDINGS = "executorch.extension.pybindings.portable_lib"


def _exir_leaf(name: str) -> ModuleType:
    """executorch/exir/<name>.py run on its own (a module that imports
    nothing of its package), not registered in sys.modules."""
    exir = importlib.util.find_spec("executorch.exir")
    path = Path(exir.submodule_search_locations[0]) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"executorch.exir.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_pybindings() -> ModuleType:
    """ExecuTorch's pybindings (and so libexecutorch.so), imported without
    `executorch.exir`: a stand-in package holding only its `_warnings` module
    is in sys.modules while they import, and gone afterwards."""
    if _PYBINDINGS in sys.modules or "executorch.exir" in sys.modules:
        return importlib.import_module(_PYBINDINGS)
    import executorch

    stand_in = ModuleType("executorch.exir")
    stand_in.__path__ = []
    names = ("executorch.exir", "executorch.exir._warnings")
    sys.modules.update(zip(names, (stand_in, _exir_leaf("_warnings"))))
    try:
        return importlib.import_module(_PYBINDINGS)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        if getattr(executorch, "exir", None) is stand_in:
            del executorch.exir


def scalar_types() -> type:
    """ExecuTorch's ScalarType enum (the dtype codes of a program's tensors)."""
    if "executorch.exir" in sys.modules:
        from executorch.exir.scalar_type import ScalarType

        return ScalarType
    return _exir_leaf("scalar_type").ScalarType
