import fcntl
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

# tests/ (harness, shared helpers) and the repository root (the fuzzing harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class SharedBuilds:
    """What several test files use (an exported program and its model
    folder), built once per run: the xdist workers share one folder, and a
    lock per build lets one worker build while the others wait for it."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, name: str, build: Callable[[Path], object]):
        """build(folder) run once per run in an empty folder of its own;
        every caller gets the folder and what build returned (picklable)."""
        import pickle
        import shutil

        folder, result = self.root / name, self.root / f"{name}.result"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not result.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed build left: each caller tries anew
                folder.mkdir()
                value = build(folder)
                result.write_bytes(pickle.dumps(value))
        return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> SharedBuilds:
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker a basetemp under one folder per run
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = base.parent / f"shared-{run}" if run else base / "shared"
    root.mkdir(exist_ok=True)
    return SharedBuilds(root)


def _cache_cia_op_collection():
    """torch.export collects every CompositeImplicitAutograd op of all ~230
    registered op namespaces twice per lowering, querying the dispatcher once
    per namespace (~0.5 s of the ~1.1 s that lowering a one-op module takes).
    The tests lower hundreds of modules: they reuse the answer for as long as
    the dispatcher's CIA registrations and the namespaces stay the same."""
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program

    collect = export_utils._collect_all_valid_cia_ops
    cache = {}

    def cached():
        key = (tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
               tuple(torch.ops._dir))
        if key not in cache:
            cache.clear()
            cache[key] = collect()
        return set(cache[key])

    for module in (export_utils, decomp_utils, exported_program):
        assert module._collect_all_valid_cia_ops is collect, module
        module._collect_all_valid_cia_ops = cached


_cache_cia_op_collection()
