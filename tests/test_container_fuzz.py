"""Issue 16: a corrupt .pte container is an error from every runner, never a
signal. Targeted cases (what ExecuTorch reads unchecked: method input/output
value indices; a truncated file; a refusal's reason) and a bounded run of
the container fuzzer (tests/container_fuzz.py; the long runs:
scripts/fuzz_container.py)."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import container_fuzz as cf
import numpy as np
import pytest
from flatbuffers.table import Table

import executorch_mlx
from executorch_mlx.llm.run.runner import LLMRunner

ROOT = Path(__file__).resolve().parent.parent
HUGE = 8847360  # the index a one-byte change gave (mutation seed 188 of the first trial)


@pytest.fixture(scope="module")
def program(shared):
    return shared.get("tiny-llama", cf.export_program)


@pytest.fixture(scope="module")
def external(shared):
    """The same program exported with its weights in llama-external.ptd."""
    return shared.get("tiny-llama-external", lambda root: cf.export_program(root, external=True))


def _emlx(pte: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6",
                           "--max-new-tokens", "3"], capture_output=True, text=True, timeout=60)


# program.fbs field ids: Program.execution_plan 1; ExecutionPlan name 0, values 2,
# inputs 3, outputs 4, non_const_buffer_sizes 8; EValue val 1; Tensor sizes 2.
def _slot(field_id: int) -> int:
    return 4 + 2 * field_id


def _plan(data: bytes, method: str) -> Table:
    program = Table(data, struct.unpack_from("<I", data, 0)[0])
    plans = program.Vector(program.Offset(_slot(1)))
    for k in range(program.VectorLen(program.Offset(_slot(1)))):
        plan = Table(data, program.Indirect(plans + 4 * k))
        if plan.String(plan.Offset(_slot(0)) + plan.Pos) == method.encode():
            return plan
    raise LookupError(method)


def _position(data: bytes, method: str, field: str, i: int = 0) -> int:
    """Byte offset of element i of `method`'s inputs, outputs (int32) or
    non_const_buffer_sizes (int64), walked with FlatBuffers' generic Table."""
    plan = _plan(data, method)
    fid, width = {"inputs": (3, 4), "outputs": (4, 4), "non_const_buffer_sizes": (8, 8)}[field]
    return plan.Vector(plan.Offset(_slot(fid))) + width * i


def _index_position(data: bytes, method: str, field: str, i: int = 0) -> int:
    return _position(data, method, field, i)


def _input_rank_positions(data: bytes, input_index: int) -> list[int]:
    """Byte offsets of the lengths of forward's input `input_index`'s sizes
    and dim_order vectors (Tensor fields 2 and 3)."""
    plan = _plan(data, "forward")
    value = struct.unpack_from("<i", data, _position(data, "forward", "inputs", input_index))[0]
    evalue = Table(data, plan.Indirect(plan.Vector(plan.Offset(_slot(2))) + 4 * value))
    tensor = Table(data, evalue.Indirect(evalue.Offset(_slot(1)) + evalue.Pos))
    return [tensor.Vector(tensor.Offset(_slot(f))) - 4 for f in (2, 3)]


@pytest.mark.parametrize("method,field,what", [("get_max_context_len", "outputs", "output"),
                                               ("forward", "inputs", "input")])
def test_a_value_index_out_of_range_is_an_error_not_an_abort(program, tmp_path, method, field, what):
    """ExecuTorch reads method outputs with an assert (get_value: i < n_value_,
    SIGABRT in emlx_runner) and inputs likewise: our checks refuse first."""
    pte, folder = program
    data = bytearray(pte.read_bytes())
    struct.pack_into("<i", data, _index_position(bytes(data), method, field), HUGE)
    bad = tmp_path / "index.pte"
    bad.write_bytes(data)
    message = rf"corrupt program: method '{method}': {what} 0 is value {HUGE} of \d+"

    done = _emlx(bad)
    assert done.returncode == 1 and re.search(message, done.stderr), done.stderr
    with pytest.raises(ValueError, match=message):
        LLMRunner(bad, folder)
    with pytest.raises(ValueError, match=message):
        LLMRunner(bytes(data), folder)
    if field == "inputs":
        return  # the CLI once (~8 s of imports): the same LLMRunner
    cli = subprocess.run([sys.executable, "-m", "executorch_mlx.cli", "generate", str(bad), "--tokenizer",
                          str(folder), "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2
    assert re.fullmatch(rf"executorch-mlx generate: error: cannot load {re.escape(str(bad))}: {message}\n",
                        cli.stderr), cli.stderr


@pytest.mark.parametrize("size", [-11192684773372, 1 << 60])
def test_a_memory_plan_out_of_range_is_an_error(program, tmp_path, size):
    """A negative planned buffer aborted in MethodMeta (Result::get); a huge
    one was allocated (and zero-filled) for seconds before anything else."""
    pte, folder = program
    data = bytearray(pte.read_bytes())
    struct.pack_into("<q", data, _position(bytes(data), "forward", "non_const_buffer_sizes", 1), size)
    bad = tmp_path / "plan.pte"
    bad.write_bytes(data)
    message = rf"corrupt program: method 'forward' plans a buffer of {size} bytes \(the memory budget is "
    done = _emlx(bad)
    assert done.returncode == 1 and re.search(message, done.stderr), done.stderr
    with pytest.raises(ValueError, match=message):
        LLMRunner(bad, folder)


def test_a_sampler_input_of_the_wrong_rank_is_an_error(program, tmp_path):
    """history read as [batch, slots]: a shape [] was an IndexError (Python)
    and vector::_M_range_check (emlx_runner)."""
    pte, folder = program
    names = LLMRunner(pte, folder).input_names
    data = bytearray(pte.read_bytes())
    for at in _input_rank_positions(bytes(data), names.index("history")):
        struct.pack_into("<I", data, at, 0)  # a rank-0 tensor
    bad = tmp_path / "rank.pte"
    bad.write_bytes(data)
    done = _emlx(bad)
    assert done.returncode == 1
    assert "emlx_runner: error: this .pte's input 'history' is not [batch, size]" in done.stderr, done.stderr
    with pytest.raises(ValueError, match=r"this \.pte's input 'history' has shape \[\], not \[batch, size\]"):
        LLMRunner(bad, folder)


def test_a_truncated_file_names_the_sizes(program, tmp_path):
    """ExecuTorch's refusal is a bare InvalidProgram (its reason only in its log)."""
    pte, folder = program
    data = pte.read_bytes()
    cut = tmp_path / "cut.pte"
    cut.write_bytes(data[: len(data) // 2])
    message = rf"truncated\? its header gives \d+ bytes of segments at byte \d+ in a file of {len(data) // 2}"
    done = _emlx(cut)
    assert done.returncode == 1 and re.search(message, done.stderr), done.stderr
    with pytest.raises(ValueError, match=message):
        LLMRunner(cut, folder)


def test_emlx_runner_says_why_the_backend_refused(program, tmp_path):
    """A weight's key changed in the named data: the method's load fails in
    our backend, and emlx_runner prints its reason after ExecuTorch's code."""
    pte, _ = program
    data = bytearray(pte.read_bytes())
    program_size = struct.unpack_from("<Q", data, 16)[0]
    at = data.index(b"emlx_", 0, program_size)  # the first named-data key, in the FlatBuffer
    data[at + 5] = ord("Z")
    bad = tmp_path / "key.pte"
    bad.write_bytes(data)
    done = _emlx(bad)
    assert done.returncode == 1
    assert re.search(r"loading method 'forward' failed \(ExecuTorch Error::InvalidProgram\): invalid program: "
                     r"constant 'emlx_\w+' not found in named data", done.stderr), done.stderr


# ------------------------------------------------------------- the fuzzer --
def test_mutations_repeat_and_reach_every_region(program):
    data = program[0].read_bytes()
    first, again = cf.cases(data, 200, seed=1), cf.cases(data, 200, seed=1)
    assert [c.data for c in first] == [c.data for c in again]
    spans = cf.regions(data)
    base = np.frombuffer(data, np.uint8)
    changed = np.concatenate([np.nonzero(np.frombuffer(c.data, np.uint8) != base)[0] for c in first
                              if len(c.data) == len(data)])
    assert any(i < 64 for i in changed) and any(i >= spans["segments"][0] for i in changed)
    assert any(len(c.data) < len(data) for c in cf.cases(data, 300, seed=1))  # truncations too


def test_a_crash_or_a_hang_is_counted_not_fatal(monkeypatch, tmp_path):
    """The harness's own guarantee, on its forked Python path."""
    def target(name, pte, folder, data=None):
        if name == "inspect":
            os.kill(os.getpid(), signal.SIGSEGV)
        if name == "generate":
            time.sleep(30)
        raise KeyError("escaped")

    monkeypatch.setattr(cf, "_python_target", target)
    case = [cf.Case(0, b"x", "test")]
    assert cf.run_python("inspect", case, tmp_path, tmp_path, timeout=5).outcomes == {cf.SIGNAL: 1}
    assert cf.run_python("generate", case, tmp_path, tmp_path, timeout=0.5).outcomes == {cf.HUNG: 1}
    report = cf.run_python("LLMRunner", case, tmp_path, tmp_path, timeout=5)
    assert report.outcomes == {cf.OTHER: 1} and "KeyError: 'escaped'" in report.failures[0]
    assert [cf.classify(rc) for rc in (0, 1, 2, 3, 134, -6)] == [
        cf.RAN, cf.REFUSED, cf.REFUSED, cf.OTHER, cf.SIGNAL, cf.SIGNAL]


def test_bounded_container_fuzzing(program, external):
    """100 mutants through emlx_runner, 30 through the Python targets, and 40
    of the weights file (.ptd) through both runners: no signal, no hang, no
    escaped exception."""
    pte, folder = program
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_container.py"), "--emlx", "100",
                           "--llmrunner", "10", "--generate", "10", "--inspect", "10", "--emlx-ptd", "30",
                           "--llmrunner-ptd", "10", "--seed", "3", "--program", str(pte), "--folder", str(folder),
                           "--external", str(external[0])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for target, n in [("emlx_runner", 100), ("LLMRunner", 10), ("generate", 10), ("inspect", 10),
                      ("emlx_runner .ptd", 30), ("LLMRunner .ptd", 10)]:
        assert re.search(rf"^{target}: {n} cases: ran \d+, refused \d+, signal 0, hung 0, other 0 ", done.stdout,
                         re.M), done.stdout
