"""Weights that wait in files, not in memory, while export runs.

Within `weight_files(folder)`, `keep(tensor)` writes a large tensor's bytes to
a file in `folder` and returns the same values mapped from that file
(copy-on-write, so nothing can change the file): the tensor reads like any
other, but its pages are on disk until something reads them, and the kernel
can drop them again. Export loads every weight this way (llm/export/streamed_load.py)
and quantizes one weight at a time into kept tensors (llm/export/quantize.py), so
that what it holds in memory does not grow with the model. When the builder
stores a constant that is a kept tensor, the named data store takes the file
itself: the bytes reach the .pte without another copy in memory.

A file lives as long as its tensor's storage (or the block, whichever ends
first): a weight replaced by its quantized form frees its disk space too.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from executorch.exir._serialize._cord import FileBackedData

# Smaller tensors stay in memory: a file each would cost more than it saves.
SPILL_BYTES = 1 << 20
_active: contextvars.ContextVar[WeightFiles | None] = contextvars.ContextVar("weight_files", default=None)


@dataclass
class _Kept:
    path: str
    nbytes: int
    sha256: bytes


class WeightFiles:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._kept: dict[int, _Kept] = {}  # storage data_ptr -> its file, while the storage lives
        self._pinned: set[str] = set()  # files the named data store reads when the program is written
        self._spilled: list[FileBackedData] = []

    def _write(self, raw, digest: bytes | None = None) -> tuple[str, bytes]:
        fd, path = tempfile.mkstemp(prefix=".emlx_", suffix=".data", dir=self.folder)
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(raw))
        return path, digest or hashlib.sha256(raw).digest()

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.nbytes < SPILL_BYTES or tensor.device.type != "cpu" or self.stored(tensor) is not None:
            return tensor
        path, digest = self._write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        return self._map(path, digest, tensor.nbytes, tensor.dtype, tensor.shape)

    def _map(self, path: str, digest: bytes, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        mapped = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8).view(dtype).reshape(shape)
        storage = mapped.untyped_storage()
        key = storage.data_ptr()
        self._kept[key] = _Kept(path, nbytes, digest)
        weakref.finalize(storage, self._forget, key, path)
        return mapped

    def stacked(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """torch.cat(tensors) (along dim 0) as a kept tensor whose file is
        written from theirs, so that their pages are never mapped into this
        process; None unless every tensor is a kept one."""
        kept = [self.stored(t) for t in tensors]
        if any(k is None for k in kept) or len({(t.dtype, t.shape[1:]) for t in tensors}) != 1:
            return None  # (torch.cat then stacks them, or says why it cannot)
        fd, path = tempfile.mkstemp(prefix=".emlx_", suffix=".data", dir=self.folder)
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for k in kept:
                with open(k.path, "rb") as f:
                    while chunk := f.read(16 << 20):
                        out.write(chunk)
                        digest.update(chunk)
        shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
        return self._map(path, digest.digest(), sum(k.nbytes for k in kept), tensors[0].dtype, shape)

    def _forget(self, key: int, path: str) -> None:
        kept = self._kept.get(key)
        if kept is not None and kept.path == path:  # (not a later tensor at a reused address)
            del self._kept[key]
        if path not in self._pinned:
            with contextlib.suppress(OSError):
                os.remove(path)

    def stored(self, tensor: torch.Tensor) -> _Kept | None:
        """The file of a kept tensor (all of it, in its own layout), else None."""
        kept = self._kept.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
        if kept is None or tensor.storage_offset() or not tensor.is_contiguous() or tensor.nbytes != kept.nbytes:
            return None
        return kept

    def data(self, tensor: torch.Tensor, raw, digest: bytes):
        """The bytes of `tensor` (`raw`, whose sha256 is `digest`) for the
        named data store: a kept tensor's own file, a new file for another
        large one (either stays until the block ends), else bytes."""
        kept = self.stored(tensor)
        if kept is not None:
            self._pinned.add(kept.path)
            return FileBackedData(kept.path, sha256=kept.sha256)
        if raw.nbytes < SPILL_BYTES:
            return raw.tobytes()
        path, digest = self._write(raw, digest)
        data = FileBackedData(path, cleanup=True, sha256=digest)
        self._spilled.append(data)
        return data

    def sha256(self, tensor: torch.Tensor) -> bytes | None:
        """A kept tensor's digest, known without reading it."""
        kept = self.stored(tensor)
        return None if kept is None else kept.sha256

    def close(self) -> None:
        for key, kept in list(self._kept.items()):
            self._forget(key, kept.path)
        for path in self._pinned:
            with contextlib.suppress(OSError):
                os.remove(path)
        for data in self._spilled:
            data.close()


@contextlib.contextmanager
def weight_files(folder: str | Path):
    """Within the block, `keep` and the builder put large weights in files
    under `folder`; the files are removed when it ends (write the program
    inside it)."""
    files = WeightFiles(folder)
    token = _active.set(files)
    try:
        yield files
    finally:
        _active.reset(token)
        files.close()


def active() -> WeightFiles | None:
    return _active.get()


def trim_heap() -> None:
    """Gives the C heap's free memory back to the system (glibc). Quantizing
    weight after weight frees blocks of tens of MiB that malloc otherwise
    keeps, fragmented: an 8B model's export held 2 GB more without it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def shared_when_copied(tensors) -> None:
    """Makes `copy.deepcopy` return each kept tensor among `tensors` itself.
    ExecuTorch's `to_backend` deep-copies the program before the backend
    reads it; a copy of a kept tensor would read its whole file into memory
    and lose the file with it (the 1.5B int4 export peaked 1.5 GB higher).
    Our backend only reads constants, so the copy may share them."""
    files = _active.get()
    for tensor in tensors if files is not None else ():
        if isinstance(tensor, torch.Tensor) and files.stored(tensor) is not None:  # (constants may be script objects)
            # copy.deepcopy looks __deepcopy__ up on the instance first
            tensor.__deepcopy__ = functools.partial(_itself, weakref.ref(tensor))


def _itself(ref: weakref.ref, memo) -> torch.Tensor:
    return ref()


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in a file while weight_files is active; else itself."""
    files = _active.get()
    return tensor if files is None else files.keep(tensor)


def stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """keep(torch.cat(tensors)), made from the files of kept tensors where
    they all are (reading them would bring every weight into memory)."""
    files = _active.get()
    stacked = None if files is None else files.stacked(tensors)
    return stacked if stacked is not None else keep(torch.cat(tensors))
