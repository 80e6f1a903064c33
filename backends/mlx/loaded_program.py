"""Programs loaded and run by our runtime plugin itself (runtime/program_api.cpp),
not through ExecuTorch's pybindings: those link libtorch, seconds to import
that running a program never needs. So `executorch-mlx generate`, `chat`,
`serve` and `LLMRunner` start without torch.

Inputs are anything `numpy.asarray` reads (numpy arrays, torch tensors on the
CPU, lists), cast to the dtype the method takes within their kind (an int64
array to int32, not a float one to ints: TypeError); outputs are numpy
arrays (copies), ints, floats, bools or strings. numpy has no bfloat16: a
bfloat16 input is rounded from float32, a bfloat16 output widened to it.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ._runtime_library import last_error, load

_MAX_RANK = 16
# ExecuTorch's ScalarType codes (c10's numbering, fixed) of the dtypes numpy has.
_DTYPES = {0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16, 6: np.float32,
           7: np.float64, 11: np.bool_}
_CODES = {np.dtype(t): code for code, t in _DTYPES.items()}
_BFLOAT16 = 15
BFLOAT16 = "bfloat16"  # a TensorSpec's dtype where numpy has none


class _Value(ctypes.Structure):  # program_api.cpp's Value
    _fields_ = [("tag", ctypes.c_int32), ("dtype", ctypes.c_int32), ("rank", ctypes.c_int64),
                ("sizes", ctypes.c_int64 * _MAX_RANK), ("data", ctypes.c_void_p), ("nbytes", ctypes.c_int64),
                ("integer", ctypes.c_int64), ("real", ctypes.c_double)]


class TensorSpec(NamedTuple):
    """A tensor input or output of a method: its dtype (a numpy dtype, or
    BFLOAT16) and its exported shape (a dynamic dimension at its bound)."""

    dtype: object
    shape: tuple[int, ...]


def as_array(value) -> np.ndarray | None:
    """A tensor given by a caller as a numpy array: numpy's own, or torch's
    (read without importing torch; bfloat16 widened to float32); None for
    anything else (numbers, lists)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "numpy"):
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.detach().cpu().numpy()
    return None


def _library() -> ctypes.CDLL:
    lib = load()
    if not getattr(lib, "_programs_declared", False):
        handle, value = ctypes.c_void_p, ctypes.POINTER(_Value)
        declare = {
            "emlx_program_load": (handle, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                                           ctypes.POINTER(ctypes.c_int)]),
            "emlx_program_use_data": (ctypes.c_int, [handle, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]),
            "emlx_program_free": (None, [handle]),
            "emlx_program_method_count": (ctypes.c_int64, [handle]),
            "emlx_program_method_name": (ctypes.c_char_p, [handle, ctypes.c_int64]),
            "emlx_method_load": (handle, [handle, ctypes.c_char_p]),
            "emlx_method_free": (None, [handle]),
            "emlx_method_inputs": (ctypes.c_int64, [handle]),
            "emlx_method_outputs": (ctypes.c_int64, [handle]),
            "emlx_method_meta": (ctypes.c_int, [handle, ctypes.c_int, ctypes.c_int64, value]),
            "emlx_method_execute": (ctypes.c_int, [handle, ctypes.c_int64, value]),
            "emlx_method_output": (ctypes.c_int, [handle, ctypes.c_int64, value]),
            "emlx_active_memory": (ctypes.c_int64, []),
        }
        for name, (restype, argtypes) in declare.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        lib._programs_declared = True
    return lib


def active_memory() -> int:
    """Bytes our runtime holds in this process now (MLX's allocator): every
    loaded program's weights, state (KV caches) and values alive."""
    return int(_library().emlx_active_memory())


def _failure(bad: ctypes.c_int) -> Exception:
    """ValueError for a file that is not a sound program, else RuntimeError."""
    return (ValueError if bad.value else RuntimeError)(last_error())


class LoadedProgram:
    """A program from a file (mapped: the delegate reads each weight once)
    or from its bytes (copied). ValueError when it is not a sound program
    (our container checks), RuntimeError when ExecuTorch cannot load it."""

    def __init__(self, source: str | Path | bytes):
        self._lib = _library()
        bad = ctypes.c_int(0)
        if isinstance(source, (bytes, bytearray)):
            self._handle = self._lib.emlx_program_load(None, bytes(source), len(source), ctypes.byref(bad))
        else:
            self._handle = self._lib.emlx_program_load(str(source).encode(), None, 0, ctypes.byref(bad))
        if not self._handle:
            raise _failure(bad)
        count = self._lib.emlx_program_method_count(self._handle)
        self.method_names = [self._lib.emlx_program_method_name(self._handle, i).decode() for i in range(count)]

    def use_data(self, path: str | Path) -> None:
        """Methods loaded from now on take their weights from this data file
        (.ptd: export --external-weights); ValueError if it is corrupt."""
        bad = ctypes.c_int(0)
        if self._lib.emlx_program_use_data(self._handle, str(path).encode(), ctypes.byref(bad)) != 0:
            raise _failure(bad)

    def load_method(self, name: str) -> LoadedMethod:
        return LoadedMethod(self, name)

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.emlx_program_free(self._handle)
            self._handle = None


def _spec(value: _Value) -> TensorSpec | None:
    if value.tag != 1:
        return None
    dtype = BFLOAT16 if value.dtype == _BFLOAT16 else np.dtype(_DTYPES.get(value.dtype, np.void))
    return TensorSpec(dtype, tuple(value.sizes[:value.rank]))


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    bits = np.asarray(x, dtype=np.float32, order="C").view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)


class LoadedMethod:
    """One method of a LoadedProgram (which it keeps alive)."""

    def __init__(self, program: LoadedProgram, name: str):
        self._lib, self._program = program._lib, program
        self._handle = self._lib.emlx_method_load(program._handle, name.encode())
        if not self._handle:
            raise RuntimeError(last_error())
        self.inputs = [self._meta(0, i) for i in range(self._lib.emlx_method_inputs(self._handle))]
        self.outputs = [self._meta(1, i) for i in range(self._lib.emlx_method_outputs(self._handle))]
        # The inputs as last passed: a decode loop passes most of them (the
        # sampler's) again, the same arrays, which then cost no work (after a
        # decode step has swept the caches, each line of Python run costs).
        # One call at a time: the packed inputs are shared between calls.
        self._lock = threading.Lock()
        self._packed = (_Value * len(self.inputs))()
        self._given: list = [None] * len(self.inputs)  # (array, shape, dtype) passed as given, else None
        self._kept: list = [None] * len(self.inputs)  # what _packed points at

    def _meta(self, output: int, i: int) -> TensorSpec | None:
        value = _Value()
        if self._lib.emlx_method_meta(self._handle, output, i, ctypes.byref(value)) != 0:
            raise RuntimeError(last_error())
        return _spec(value)

    def execute(self, values) -> list:
        """Runs the method on `values` (one per input); RuntimeError with our
        runtime's reason when it fails. An input given as the very array of
        the last call (its shape and dtype unchanged) is passed again as it
        is: its contents are read at the call, as always."""
        if len(values) != len(self.inputs):
            raise ValueError(f"the method takes {len(self.inputs)} inputs, got {len(values)}")
        with self._lock:
            for i, value in enumerate(values):
                given = self._given[i]
                if given is None or value is not given[0] or value.shape != given[1] or value.dtype is not given[2]:
                    self._pack(i, value)
            if self._lib.emlx_method_execute(self._handle, len(values), self._packed) != 0:
                raise RuntimeError(last_error())
            return [self._output(i) for i in range(len(self.outputs))]

    def _pack(self, i: int, value) -> None:
        spec = self.inputs[i]
        self._given[i] = None
        if type(value) is np.ndarray and spec is not None and value.dtype == spec.dtype and value.flags.c_contiguous:
            array, code = value, _CODES[value.dtype]  # (as the method takes it)
        else:
            array, code = self._converted(i, value, spec)
        if array.ndim > _MAX_RANK:
            raise ValueError(f"input {i} has rank {array.ndim}; at most {_MAX_RANK}")
        slot = self._packed[i]
        slot.tag, slot.dtype, slot.rank = 1, code, array.ndim
        slot.sizes[:array.ndim] = array.shape
        slot.data = array.__array_interface__["data"][0]
        self._kept[i] = array
        if array is value:  # (a converted copy would not see changes to the given array)
            self._given[i] = (value, value.shape, value.dtype)

    @staticmethod
    def _converted(i: int, value, spec) -> tuple[np.ndarray, int]:
        """Input i as the method takes it (within its dtype's kind), with its dtype code."""
        array = as_array(value)  # (torch's bfloat16 too)
        value = value if array is None else array
        if spec is None:
            raise ValueError(f"input {i} of the method is not a tensor: this runner passes only tensors")
        dtype = getattr(value, "dtype", None)
        want = np.float32 if spec.dtype == BFLOAT16 else spec.dtype
        if isinstance(dtype, np.dtype) and not np.can_cast(dtype, want, casting="same_kind"):
            raise TypeError(f"input {i} takes {spec.dtype}, got {dtype}")
        if spec.dtype == BFLOAT16:
            return _to_bfloat16(np.asarray(value, dtype=np.float32)), _BFLOAT16
        array = np.asarray(value, dtype=spec.dtype, order="C")
        return array, _CODES[array.dtype]

    def _output(self, i: int):
        value = _Value()
        if self._lib.emlx_method_output(self._handle, i, ctypes.byref(value)) != 0:
            raise RuntimeError(last_error())
        if value.tag == 1:
            shape = tuple(value.sizes[:value.rank])
            if value.dtype == _BFLOAT16:
                bits = np.ctypeslib.as_array((ctypes.c_uint16 * (value.nbytes // 2)).from_address(value.data))
                return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)
            # (numpy's C paths only: its `.ctypes` runs Python code, slow
            # after a decode step has swept the caches)
            raw = ctypes.string_at(value.data, value.nbytes) if value.nbytes else b""
            return np.frombuffer(raw, dtype=_DTYPES[value.dtype]).reshape(shape).copy()
        if value.tag == 5:
            return ctypes.string_at(value.data, value.nbytes).decode()
        return {0: None, 2: value.integer, 3: value.real, 4: bool(value.integer)}[value.tag]

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.emlx_method_free(self._handle)
            self._handle = None
