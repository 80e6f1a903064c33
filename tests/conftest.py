import fcntl
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

# tests/ (harness, shared helpers) and the repository root (the fuzzing harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]


# Test files, longest first (by `--durations` on a fresh clone of the 2-core
# machine). xdist hands a worker the next file when it is nearly done
# with its last (scripts/dev runs --dist loadfile --no-loadscope-reorder), so
# starting with the long files keeps both workers busy to the end: a long
# file started last kept one worker alone for the final ~100 s.
LONGEST_FIRST = ["test_llm.py", "test_ops.py", "test_hardening.py", "test_documented_commands.py",
                 "test_llm_ops.py", "test_quantized.py", "test_fuzz.py", "test_sampler.py", "test_speculative.py",
                 "test_state_layers.py", "test_experts.py", "test_ring_cache.py", "test_family_quirks.py",
                 "test_mlx_folders.py", "test_gguf.py", "test_mxfp4_folders.py",
                 "test_sampling.py", "test_runtime.py", "test_container_fuzz.py", "test_serve.py", "test_hostile_input.py",
                 "test_docs_and_tools.py", "test_structured.py", "test_cpp_runner.py", "test_structure.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


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


def _cache_callable_subscriptions():
    """torch.export overrides the decomposition of ~550 CompositeImplicitAutograd
    ops around each run_decompositions, through OperatorBase.py_impl, whose
    nested function's annotations subscribe collections.abc.Callable anew on
    every call. torch._ops gets a Callable whose subscriptions are cached
    (isinstance and issubclass as before): lowering and running a one-op
    module takes 0.26 s instead of 0.35 s."""
    import collections.abc
    import torch._ops as ops

    assert ops.Callable is collections.abc.Callable
    aliases = {}

    class CachedMeta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, collections.abc.Callable)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, collections.abc.Callable)

        def __getitem__(cls, params):
            try:
                return aliases[params]
            except KeyError:
                alias = aliases[params] = collections.abc.Callable[params]
                return alias
            except TypeError:  # a list of argument types is not hashable: not cached
                return collections.abc.Callable[params]

    class Callable(metaclass=CachedMeta):
        pass

    ops.Callable = Callable


_cache_callable_subscriptions()


def _reuse_cia_overrides():
    """run_decompositions overrides the decomposition of ~560 CompositeImplicitAutograd
    ops while it traces (~12,000 py_impl registrations, ~0.07 s) and restores
    them after, twice per lowering: 0.14 s of the 0.33 s that lowering and
    running a one-op module takes, and the tests lower ~950 programs. The
    tables it installs depend only on what it is given and on each op's
    tables and fake rule before it: the first time, torch's own override runs
    and its tables are kept; after, they are copied in, and restored on exit
    as torch restores them."""
    import contextlib

    import torch._subclasses.fake_impls as fake_impls
    import torch.export.exported_program as exported_program

    override = exported_program._override_composite_implicit_decomp
    rules = fake_impls.op_implementations_dict
    installed = {}  # what torch's override left in place, by what it was given and found

    @contextlib.contextmanager
    def reused(cia_ops_to_callable):
        before = {op: op.py_kernels.copy() for op in cia_ops_to_callable}
        unruled = {op for op in cia_ops_to_callable if op not in rules}
        key = tuple((op, decomp, tuple(before[op].items()), op in unruled)
                    for op, decomp in cia_ops_to_callable.items())
        if key not in installed:
            with override(cia_ops_to_callable):
                if len(installed) > 8:
                    installed.clear()
                installed[key] = ({op: op.py_kernels.copy() for op in cia_ops_to_callable},
                                  {op: rules[op] for op in unruled if op in rules})
                yield
            return
        tables, fake_rules = installed[key]
        try:
            for op, table in tables.items():
                op.py_kernels.clear()
                op.py_kernels.update(table)
                op._dispatch_cache.clear()
            rules.update(fake_rules)
            yield
        finally:  # torch's exit, step for step
            for op, table in before.items():
                op.py_kernels.clear()
                op.py_kernels.update(table)
                op._dispatch_cache.clear()
                fake_impls._deregister_op_impl(op)

    assert exported_program._decompose_and_get_gm_with_new_signature_constants.__globals__[
        "_override_composite_implicit_decomp"] is override
    exported_program._override_composite_implicit_decomp = reused


_reuse_cia_overrides()
