"""Loads the compiled runtime plugin into this process.

The plugin links the executorch wheel's libexecutorch.so and registers its
backend from a static initializer. That libexecutorch.so (the one ExecuTorch's
pybindings link too) and mlx.core are loaded first, so that the very libraries
it links are already there (one backend registry, one MLX), whatever rpath
the platform honours. Not the pybindings themselves: they link libtorch,
seconds to import, and running a program needs none of it (loaded_program.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sysconfig
from contextlib import contextmanager
from pathlib import Path

LIBRARY_NAME = "libexecutorch_mlx_backend.so"
RUNNER_NAME = "emlx_runner"


def _candidates(name: str = LIBRARY_NAME) -> list[Path]:
    import executorch_mlx

    dirs = [Path(p) for p in executorch_mlx.__path__]
    # Editable installs keep Python sources in the checkout and the built
    # library in site-packages.
    dirs.append(Path(sysconfig.get_paths()["platlib"]) / "executorch_mlx")
    return [d / name for d in dirs]


def runner_binary() -> Path:
    """The installed C++ LLM runner (runtime/llm_runner.cpp)."""
    for path in _candidates(RUNNER_NAME):
        if path.exists():
            return path
    raise FileNotFoundError(f"{RUNNER_NAME} not found in {[str(p.parent) for p in _candidates(RUNNER_NAME)]}; "
                            "reinstall the package (pip install .)")


def _load_executorch() -> None:
    """The executorch wheel's libexecutorch.so, global: the library its
    pybindings link, so both share one backend registry."""
    import importlib.util

    folder = Path(importlib.util.find_spec("executorch").submodule_search_locations[0]) / "lib"
    for name in ("libexecutorch.so", "libexecutorch.dylib"):
        if (folder / name).exists():
            ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
            return
    raise ImportError(f"executorch_mlx: libexecutorch not found in {folder}; reinstall executorch")


@contextmanager
def _openblas_without_threads():
    """The plugin's OpenBLAS, which our kernels call single-threaded from
    their own threads, starts a thread as it loads that spins for about
    0.1 s, a core taken from loading and the first prefill, unless
    OPENBLAS_NUM_THREADS is set then (a value the user set is kept)."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


@functools.cache
def load() -> ctypes.CDLL:
    import mlx.core  # noqa: F401  (libmlx.so)

    _load_executorch()

    for path in _candidates():
        if path.exists():
            with _openblas_without_threads():
                lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.emlx_last_error.restype = ctypes.c_char_p
            lib.emlx_backend_id.restype = ctypes.c_char_p
            lib.emlx_memory_budget.restype = ctypes.c_uint64
            lib.emlx_set_memory_budget.argtypes = [ctypes.c_uint64]
            lib.emlx_check_program.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64]
            lib.emlx_state_snapshot.restype = ctypes.c_uint64
            lib.emlx_state_snapshot.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
            lib.emlx_state_restore.argtypes = [ctypes.c_uint64]
            lib.emlx_state_drop.argtypes = [ctypes.c_uint64]
            lib.emlx_state_snapshot_row.restype = ctypes.c_uint64
            lib.emlx_state_snapshot_row.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]
            lib.emlx_state_copy_row.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64]
            if not lib.emlx_registered():
                raise RuntimeError(f"{path}: backend registration failed (is the id already taken?)")
            return lib
    raise ImportError(
        f"executorch_mlx: runtime plugin {LIBRARY_NAME} not found in "
        f"{[str(p.parent) for p in _candidates()]}; reinstall the package (pip install .)"
    )


def last_error() -> str:
    """The runtime's reason for the last failure on this thread ('' if none)."""
    return load().emlx_last_error().decode()


def check_program(source: str | bytes) -> None:
    """Our checks of a .pte container (runtime/program_checks.h) before
    ExecuTorch reads it: `source` is a path or the file's bytes. Raises
    ValueError naming what is corrupt."""
    lib = load()
    if isinstance(source, bytes):
        rc = lib.emlx_check_program(None, source, len(source))
    else:
        rc = lib.emlx_check_program(str(source).encode(), None, 0)
    if rc != 0:
        raise ValueError(last_error())


def clear_last_error() -> None:
    """Forgets the last failure on this thread (a caller that runs many
    programs can then tell whose error last_error() reports)."""
    load().emlx_clear_last_error()


# Counts reset_state() and restore_state() calls: a runner that remembers what its cache holds
# (llm/run/runner.py) forgets it when this changes.
reset_count = 0


def reset_state() -> None:
    """Sets the persistent state (KV caches) of every program loaded in this
    process back to its initial value: a new conversation without a reload."""
    global reset_count
    reset_count += 1
    if load().emlx_reset_state() != 0:
        raise RuntimeError(last_error())


def snapshot_state() -> tuple[int, int]:
    """Holds the persistent state (KV caches) of every program loaded in
    this process as it is now: (the snapshot's id, its bytes). Held by
    reference: the programs' next updates copy what they change."""
    size = ctypes.c_uint64()
    snapshot = load().emlx_state_snapshot(ctypes.byref(size))
    if snapshot == 0:
        raise RuntimeError(last_error())
    return snapshot, size.value


def restore_state(snapshot: int) -> None:
    """Sets every program's state back to `snapshot` (those loaded since: to
    their initial state). Like reset_state, it tells every runner that its
    cache holds something else now."""
    global reset_count
    reset_count += 1
    if load().emlx_state_restore(snapshot) != 0:
        raise RuntimeError(last_error())


def snapshot_state_row(row: int, rows: int) -> tuple[int, int]:
    """Keeps row `row` of every loaded program's buffers of `rows` rows (a
    batched program's cache rows: llm/run/batch.py), copied: (the snapshot's
    id, its bytes). drop_state forgets it."""
    size = ctypes.c_uint64()
    snapshot = load().emlx_state_snapshot_row(row, rows, ctypes.byref(size))
    if snapshot == 0:
        raise RuntimeError(last_error())
    return snapshot, size.value


def copy_state_row(snapshot: int, row: int, rows: int) -> None:
    """Puts a snapshot_state_row back as row `row` (in place); every other
    row stays as it is."""
    if load().emlx_state_copy_row(snapshot, row, rows) != 0:
        raise RuntimeError(last_error())


def drop_state(snapshot: int) -> None:
    load().emlx_state_drop(snapshot)


def memory_budget() -> int:
    """Bytes a program loaded now may hold at once as it runs (the values
    alive together, and its KV cache; weights are not counted): the value of
    set_memory_budget, else the EMLX_MEMORY_BUDGET environment variable
    ("8G", "512M", "30%", bytes), else a quarter of physical memory. Loading
    a program that would exceed it fails with an error naming both sizes."""
    budget = load().emlx_memory_budget()
    if budget == 0:
        raise ValueError(last_error())
    return budget


def set_memory_budget(nbytes: int | None) -> None:
    """Sets the memory budget of programs loaded from now on (None: back to
    the default). C++ callers: the backend option "memory_budget_kib"."""
    if nbytes is None:
        nbytes = 0
    elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"memory budget must be a positive int of bytes or None, got {nbytes!r}")
    load().emlx_set_memory_budget(nbytes)
