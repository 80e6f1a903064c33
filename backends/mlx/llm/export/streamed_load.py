"""Loads a model folder one tensor at a time into files (lowering/weight_files.py).

transformers' from_pretrained builds the model on the meta device, then
reads, converts (dtype, renamed or fused tensors) and sets each parameter.
Within `streamed_load(folder)`, while weight files are active, each
parameter is put in a file the moment it is set, so the model never holds
more than a few tensors in memory; the loading is sequential (transformers'
reader threads would otherwise read every tensor ahead of the one being
set); and the pages of the checkpoint that safetensors maps to read it are
dropped from the process as it goes (on Linux), or the resident set would
grow to the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from ...lowering import weight_files
from .module_globals import replaced

MADV_DONTNEED = 4  # Linux: drop the pages; a shared file mapping reads them again from the file if touched


def release_mapped_pages(path: str | Path) -> None:
    """Drops this process's mapped pages of a folder's safetensors files, or
    of one file (clean pages of read-only file mappings: nothing is lost)."""
    path = Path(path).resolve()
    folder = str(path) + "/" if path.is_dir() else None
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:  # not Linux
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    for line in lines:
        fields = line.split(maxsplit=5)
        mapped = fields[5] if len(fields) == 6 else ""
        if (mapped.startswith(folder) and mapped.endswith(".safetensors")) if folder else mapped == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


@contextlib.contextmanager
def streamed_load(folder: str | Path):
    files = weight_files.active()
    if files is None:
        yield
        return
    from transformers import core_model_loading

    set_param = core_model_loading.set_param_for_module

    def set_kept(model, target_name, param_value, *args, **kwargs):
        release_mapped_pages(folder)  # the value is read (copied) by now: the pages it came from can go
        set_param(model, target_name, files.keep(param_value), *args, **kwargs)

    async_load = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        with replaced(core_model_loading, "set_param_for_module", set_kept):
            yield
    finally:
        if async_load is None:
            del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = async_load
