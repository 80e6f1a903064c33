"""Loads a program exported by this package and runs it with inputs found by
name: the part every runner shares, for LLM programs (`LLMRunner`) and
sampling heads (`SampledDecoder`) alike. Their contract (metadata and input
names) is llm/program_contract.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .. import program_contract
from ..sampler_inputs import program_inputs


@contextmanager
def _loading(label, *kinds: type[Exception]):
    """Says which program failed to load, for errors of `kinds`: RuntimeError
    (ExecuTorch's, with our runtime's reason) and ValueError (a file our
    checks refuse)."""
    try:
        yield
    except kinds as e:
        raise type(e)(f"cannot load {label}: {e}") from (e if isinstance(e, RuntimeError) else None)


def weights_path(weights_file: str | None, given: str | Path | None, program: str | Path | None,
                 label) -> Path | None:
    """The data file a program's weights load from: `given`, else the file its
    metadata names (`weights_file`) beside the `program` path; None for a
    program that holds its weights."""
    if weights_file is None:
        if given is not None:
            raise ValueError(f"{label} holds its weights: it takes no data file ({given})")
        return None
    if given is None and program is None:
        raise FileNotFoundError(f"{label} keeps its weights in {weights_file}: give its path (data_path)")
    path = Path(given) if given is not None else Path(program).parent / weights_file
    if not path.is_file():
        raise FileNotFoundError(f"{label} keeps its weights in {weights_file}; {path} does not exist (keep the "
                                f"two files together, or give the data file's path)")
    return path


class ProgramRunner:
    """One method of a program that carries our contract, ready to run.

    `program` is a path (ExecuTorch maps the file) or the bytes of a .pte.
    `hint` ends the messages about a program that lacks the contract.
    A program exported with its weights in a data file (export
    --external-weights) loads them from `data_path`, by default the file
    its metadata names, beside the program.
    """

    def __init__(self, program: str | Path | bytes, method: str = "forward",
                 hint: str = "export it with executorch-mlx export", data_path: str | Path | None = None):
        from executorch_mlx._runtime_library import clear_last_error
        from executorch_mlx.loaded_program import LoadedProgram

        named = not isinstance(program, (bytes, bytearray))
        label = program if named else "the program"
        if not named:
            source = bytes(program)
        elif not Path(program).is_file():
            raise FileNotFoundError(f"program {program} does not exist")
        else:
            # By path, the file is mapped: the delegate reads each weight once
            # and unmaps it, so memory stays near the weights' size (bytes are
            # copied and held as well: twice that).
            source = str(program)
        clear_last_error()
        with _loading(label, RuntimeError, ValueError):
            # Our checks of the file (its identifier, the container, what
            # ExecuTorch reads later without a bounds check such as method
            # input/output indices: an assert would abort) run before
            # ExecuTorch reads it: ValueError names what is corrupt.
            self.program = LoadedProgram(source)
        with _loading(label, RuntimeError):
            self.contract = program_contract.read(self.program, method, hint)
            data = weights_path(self.contract.weights_file, data_path, program if named else None, label)
            if data is not None:
                with _loading(label, ValueError):
                    self.program.use_data(data)  # checked as the program is
            self.method = self.program.load_method(method)
        program_contract.read_signature(self.contract, self.method, hint)
        self.input_names = self.contract.input_names
        self.input_shapes = self.contract.input_shapes
        self.logprobs = self.contract.logprobs

    def sampler_values(self, names: list[str], given: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The program's sampler inputs `names` from checked values; what is not given is off."""
        return program_inputs(names, {name: self.input_shapes[name] for name in names}, given)

    def execute(self, values: list) -> list:
        """Runs the method on numpy arrays (or what numpy.asarray reads), one
        per input; returns numpy arrays. A failure says our runtime's reason."""
        from executorch_mlx._runtime_library import clear_last_error

        clear_last_error()
        try:
            return self.method.execute(values)
        except RuntimeError as e:
            raise RuntimeError(f"the program failed: {e}") from e
