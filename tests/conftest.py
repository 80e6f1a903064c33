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
                 "test_sampling.py", "test_runtime.py", "test_container_fuzz.py", "test_serve.py",
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


def _lighter_cia_override():
    """torch.export swaps in the decomposition of each of the ~560
    CompositeImplicitAutograd ops twice per lowering, and back after it
    (_override_composite_implicit_decomp): ~0.12 s of the ~0.33 s that
    lowering and running a one-op module takes, most of it in
    OperatorBase.py_impl's checks and dispatch-cache clears, once per key
    registered. The copy below makes the same changes to each op's
    py_kernels (the keys that py_impl's checks let through, in the same
    order), clears its dispatch cache once, and registers and drops the same
    fake-tensor rule: 0.06 s instead. It replaces torch's function only while
    that is the version it was copied from (torch 2.13.0)."""
    import contextlib
    import functools
    import hashlib
    import inspect

    import torch.export.exported_program as exported_program
    from torch._export.utils import _get_decomp_for_cia
    from torch._higher_order_ops.utils import autograd_not_implemented
    from torch._subclasses.fake_impls import _deregister_op_impl, _is_op_registered_to_fake_rule, register_op_impl

    original = exported_program._override_composite_implicit_decomp
    source = inspect.getsource(getattr(original, "__wrapped__", original))
    if hashlib.sha256(source.encode()).hexdigest() != "4422dc79d0792af728dd8eacf0a2fadcf00195c8802ceca15632b737d9d5c9bd":
        return  # another torch: its own function
    cia = torch._C.DispatchKey.CompositeImplicitAutograd

    def force_dispatch_to_orig_cia_callable(fake_tensor_mode, op, *args, **kwargs):
        orig_cia_callable = kwargs.pop("original_callable")
        with fake_tensor_mode:
            return orig_cia_callable(*args, **kwargs)

    @contextlib.contextmanager
    def override(cia_ops_to_callable):
        saved_tables = {}
        for op, decomp_callable in cia_ops_to_callable.items():
            kernels = op.py_kernels
            saved_tables[op] = kernels.copy()
            for key in exported_program._AUTOGRAD_ALIAS_BACKEND_KEYS_TO_OVERRIDE:
                if key not in kernels:
                    kernels[key] = autograd_not_implemented(op, deferred_error=True)
            orig_cia_callable = _get_decomp_for_cia(op)  # before the CIA kernel is replaced
            kernels.pop(cia, None)
            kernels[cia] = decomp_callable
            if not _is_op_registered_to_fake_rule(op):
                register_op_impl(op)(functools.partial(force_dispatch_to_orig_cia_callable,
                                                       original_callable=orig_cia_callable))
            for key in exported_program._BACKEND_KEYS_TO_OVERRIDE:
                if key not in kernels:
                    kernels[key] = orig_cia_callable
            op._dispatch_cache.clear()
        try:
            yield
        finally:
            for op, table in saved_tables.items():
                op.py_kernels.clear()
                op.py_kernels.update(table)
                op._dispatch_cache.clear()
                _deregister_op_impl(op)

    exported_program._override_composite_implicit_decomp = override


_lighter_cia_override()
