"""ExecuTorch's Python runtime without its export stack, for those who run
our programs through it (`executorch.runtime.Runtime`).

ExecuTorch's pybindings (`portable_lib`) import `executorch.exir`, the whole
export stack with torchao (about 8 s on a 2-core machine), for one warning
class. Running a program does not need it: once `executorch_mlx` is
imported, the pybindings import with a stand-in `executorch.exir` that holds
only that warnings module (run from its file), gone again afterwards. So
`import executorch_mlx; from executorch.runtime import Runtime` takes the
seconds of torch, not ten. `executorch.exir` itself stays unimported, for
whoever exports to import for real; once it is, the pybindings import as
they are. (Our own runners need no pybindings: loaded_program.py.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PYBINDINGS = "executorch.extension.pybindings.portable_lib"
_STAND_IN = ("executorch.exir", "executorch.exir._warnings")


def _exir_leaf(name: str) -> ModuleType:
    """executorch/exir/<name>.py run on its own (a module that imports
    nothing of its package), not registered in sys.modules."""
    exir = importlib.util.find_spec("executorch.exir")
    path = Path(exir.submodule_search_locations[0]) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"executorch.exir.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _WithStandIn(importlib.abc.Loader):
    """The pybindings' own loader, run with the stand-in in sys.modules."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import executorch

        stand_in = ModuleType("executorch.exir")
        stand_in.__path__ = []
        sys.modules.update(zip(_STAND_IN, (stand_in, _exir_leaf("_warnings"))))
        try:
            self.loader.exec_module(module)
        finally:
            for name in _STAND_IN:
                sys.modules.pop(name, None)
            if getattr(executorch, "exir", None) is stand_in:
                del executorch.exir


class _PybindingsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _PYBINDINGS or "executorch.exir" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _WithStandIn(spec.loader)
        return spec


def install() -> None:
    """From now on, ExecuTorch's pybindings import without its export stack."""
    if not any(isinstance(f, _PybindingsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PybindingsFinder())
