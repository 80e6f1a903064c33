"""Loads a program exported by this package and runs it with inputs found by
name: the part every runner shares, for LLM programs (`LLMRunner`) and
sampling heads (`SampledDecoder`) alike. Their contract (metadata and input
names) is llm/program_contract.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .. import program_contract
from ..sampler_inputs import program_inputs

# ExecuTorch's load errors reach Python as a bare code ("error: 0x:23"); its
# reason goes to its log (stderr).
_EXECUTORCH_ERRORS = {0x12: "InvalidArgument", 0x20: "NotFound", 0x21: "MemoryAllocationFailed",
                      0x22: "AccessFailed", 0x23: "InvalidProgram", 0x24: "InvalidExternalData",
                      0x25: "OutOfResources"}


def _named_error(e: Exception) -> str:
    m = re.search(r"error:? 0x:?([0-9a-fA-F]+)", str(e))
    name = _EXECUTORCH_ERRORS.get(int(m.group(1), 16)) if m else None
    return f"{e} ({name}; ExecuTorch logs the reason)" if name else str(e)


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
    from executorch_mlx._runtime_library import check_data_file

    try:
        check_data_file(path)  # ExecuTorch trusts the file's offsets
    except ValueError as e:
        raise ValueError(f"cannot load {label}: {e}") from None
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
        import executorch_mlx  # noqa: F401  (registers the backend)
        from executorch.runtime import Runtime

        from executorch_mlx._runtime_library import check_program, clear_last_error, last_error
        from executorch_mlx.inspector import check_identifier

        named = not isinstance(program, (bytes, bytearray))
        label = program if named else "the program"
        if not named:
            source = bytes(program)
            head = source[:8]
        elif not Path(program).is_file():
            raise FileNotFoundError(f"program {program} does not exist")
        else:
            # By path, ExecuTorch maps the file: the delegate reads each weight
            # once and unmaps it, so memory stays near the weights' size
            # (bytes would be held by ExecuTorch as well: twice that).
            source = str(program)
            with open(source, "rb") as f:
                head = f.read(8)
        check_identifier(head, label)
        try:
            # What ExecuTorch reads later without a bounds check (method
            # input/output indices) is checked here: an assert would abort.
            check_program(source)
        except ValueError as e:
            raise ValueError(f"cannot load {label}: {e}") from None
        clear_last_error()
        try:
            # Keep the Program: a Method does not keep its Program alive.
            self.program = Runtime.get().load_program(source)
            self.contract = program_contract.read(self.program, method, hint)
            data = weights_path(self.contract.weights_file, data_path, program if named else None, label)
            if data is not None:
                self.program = Runtime.get().load_program(source, data_path=str(data))
            self.method = self.program.load_method(method)
        except RuntimeError as e:
            raise RuntimeError(f"cannot load {label}: {last_error() or _named_error(e)}") from e
        self.input_names = self.contract.input_names
        self.input_shapes = self.contract.input_shapes
        self.logprobs = self.contract.logprobs

    def sampler_values(self, names: list[str], given: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The program's sampler inputs `names` from checked values; what is not given is off."""
        return program_inputs(names, {name: self.input_shapes[name] for name in names}, given)

    def execute(self, values: list[torch.Tensor]) -> list:
        """Runs the method; a failure says our runtime's reason."""
        from executorch_mlx._runtime_library import clear_last_error, last_error

        clear_last_error()
        try:
            return self.method.execute(values)
        except RuntimeError as e:
            # ExecuTorch reports an error code; the reason is our runtime's
            # (kept per thread, so read in this one)
            raise RuntimeError(f"the program failed: {last_error() or e}") from e
