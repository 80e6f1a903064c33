import sys
from pathlib import Path

import pytest
import torch

# tests/ (harness, shared helpers) and the repository root (the fuzzing harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
