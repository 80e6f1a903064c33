"""Runs programs in a process of their own, for what our runtime reads once
per process (EMLX_X86_KERNELS, EMLX_NUM_THREADS, EMLX_DISABLE_CPU_KERNELS).

The process loads them with executorch_mlx.loaded_program, which imports
neither torch nor ExecuTorch's pybindings: ~0.5 s to start instead of ~4.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from executorch_mlx.loaded_program import as_array

_SCRIPT = """
import pickle, sys
from executorch_mlx.loaded_program import BFLOAT16, LoadedProgram
with open(sys.argv[1], "rb") as f:
    calls = pickle.load(f)
out = []
for pte, each in calls:
    method = LoadedProgram(pte).load_method("forward")
    bf16 = [spec is not None and spec.dtype == BFLOAT16 for spec in method.outputs]
    out.append([(method.execute(inputs), bf16) for inputs in each])
with open(sys.argv[2], "wb") as f:
    pickle.dump(out, f)
"""


def _array(value) -> np.ndarray:
    array = as_array(value)  # (torch's bfloat16 widened)
    return np.asarray(value) if array is None else array


def _tensor(value, bf16: bool):
    if not isinstance(value, np.ndarray):
        return value
    t = torch.from_numpy(value)
    return t.to(torch.bfloat16) if bf16 else t  # (widened from bfloat16 there: exact)


def run_elsewhere(calls: list[tuple[str | Path, list[list]]], env: dict[str, str], tmp: Path) -> list[list[list]]:
    """For each (program path, [inputs, ...]): the outputs of forward on each
    inputs list, as torch tensors, run in a new process with `env` added."""
    given, got = tmp / "elsewhere-in.pkl", tmp / "elsewhere-out.pkl"
    given.write_bytes(pickle.dumps([(str(pte), [[_array(x) for x in inputs] for inputs in each])
                                    for pte, each in calls]))
    subprocess.run([sys.executable, "-c", _SCRIPT, given, got], check=True, env={**os.environ, **env})
    return [[[_tensor(y, bf16) for y, bf16 in zip(outputs, flags)] for outputs, flags in each]
            for each in pickle.loads(got.read_bytes())]
