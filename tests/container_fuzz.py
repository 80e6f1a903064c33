"""Container-level fuzzing (issue 16): byte mutations anywhere in a real LLM
.pte (header, FlatBuffer, segments, weights), each run in its own process by
a target, so that a crash (a signal) or a hang is counted, not fatal.

Targets: `emlx_runner` (the C++ runner, a subprocess per case), and three
Python ones: `LLMRunner` (load + generate), `generate` and `inspect` (the
`executorch-mlx` command line's main()); and the weights file of a program
exported with external weights (.ptd), mutated instead of the program, through
both runners (`emlx_runner .ptd`, `LLMRunner .ptd`). Python cases run in a child forked
from a server process that has imported the package once and run nothing
(spawning a Python per case costs ~8 s of imports on 2 cores, which the
10 s hang limit could not tell from a hang); `spawn=True` runs the real
console command instead.

Outcomes: ran (exit 0), refused (exit 1 or 2: an error message), signal
(killed by a signal, or exit >= 128), hung (over the timeout), other (any
other exit code; a Python target exits 3 on an exception the code under test
should have turned into an error). Used by scripts/fuzz_container.py (the long
runs) and tests/test_container_fuzz.py (a bounded run).
"""

from __future__ import annotations

import collections
import faulthandler
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

EMLX = "emlx_runner"
PYTHON_TARGETS = ("LLMRunner", "generate", "inspect")
DATA_TARGETS = (f"{EMLX} .ptd", "LLMRunner .ptd")  # the .ptd mutated, the program as exported
TARGETS = (EMLX, *PYTHON_TARGETS, *DATA_TARGETS)
RAN, REFUSED, SIGNAL, HUNG, OTHER = "ran", "refused", "signal", "hung", "other"
OUTCOMES = (RAN, REFUSED, SIGNAL, HUNG, OTHER)
MAX_CONTEXT = 64
PROMPT_IDS = "5,6"
PROMPT = "hi"
NEW_TOKENS = "3"
UNCAUGHT = 3  # a Python target's exit code for an exception that escaped


# ---------------------------------------------------------------- program --
def export_program(root: str | Path, seed: int = 0, external: bool = False) -> tuple[Path, Path]:
    """A tiny Llama folder (seeded weights, an all-bytes tokenizer: sampled
    text splits UTF-8) exported at max context 64: (the .pte, the folder);
    `external`: llama-external.pte, its weights in llama-external.ptd beside it.
    tests/test_hardening.py uses the same program. Run this in a process that
    forks no cases (export starts torch's thread pools; see run_python)."""
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.model_folders import write_model_folder

    root = Path(root)
    folder = root / "llama"
    if not (folder / "config.json").is_file():
        write_model_folder(folder, "llama", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=seed,
                           all_bytes=True)
    pte = export_llm(folder, root / ("llama-external.pte" if external else "llama.pte"),
                     ExportOptions(max_context=MAX_CONTEXT, external_weights=external), progress=None)
    return Path(pte), folder


def export_program_in_subprocess(root: str | Path, seed: int = 0, external: bool = False) -> tuple[Path, Path]:
    root = Path(root)
    subprocess.run([sys.executable, __file__, "export", str(root), str(seed), str(int(external))], check=True)
    return root / ("llama-external.pte" if external else "llama.pte"), root / "llama"


# -------------------------------------------------------------- mutations --
def regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges mutations are drawn from. The weights are most of the
    bytes, so the header, the first KiBs and the FlatBuffer get their share."""
    size = len(data)
    program = size
    if size >= 32 and data[8:12] == b"eh00":
        program = min(size, struct.unpack_from("<Q", data, 16)[0])
    return {"header": (0, min(size, 64)), "first 4 KiB": (0, min(size, 4096)),
            "flatbuffer": (0, program), "segments": (program, size), "anywhere": (0, size)}


WEIGHTS = {"header": 2, "first 4 KiB": 3, "flatbuffer": 3, "segments": 1, "anywhere": 1}
SPECIAL = (0x00, 0x01, 0x7F, 0x80, 0xFF)


@dataclass
class Case:
    index: int
    data: bytes
    what: str  # the mutations, to reproduce a failure by hand


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """1 to 16 changed bytes (set, a special value, a flipped bit) in regions
    weighted as WEIGHTS, or now and then a truncation."""
    if rng.random() < 0.03:
        n = rng.randrange(len(data))
        return data[:n], f"truncated to {n}"
    b = bytearray(data)
    spans = regions(data)
    names = [n for n in WEIGHTS if spans[n][1] > spans[n][0]]
    changes = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 4, 16])):
        name = rng.choices(names, [WEIGHTS[n] for n in names])[0]
        lo, hi = spans[name]
        at = rng.randrange(lo, hi)
        kind = rng.randrange(3)
        b[at] = rng.randrange(256) if kind == 0 else rng.choice(SPECIAL) if kind == 1 else b[at] ^ (1 << rng.randrange(8))
        changes.append(f"{at}={b[at]}")
    return bytes(b), "set " + " ".join(changes)


def cases(data: bytes, count: int, seed: int = 0, target: str = "") -> list[Case]:
    """`count` mutants of `data`, the same for the same (seed, target)."""
    out = []
    for i in range(count):
        mutated, what = mutate(data, random.Random(f"{seed}:{target}:{i}"))
        out.append(Case(i, mutated, what))
    return out


# ----------------------------------------------------------------- report --
@dataclass
class Report:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    reasons: collections.Counter = field(default_factory=collections.Counter)  # last stderr line, numbers elided
    failures: list[str] = field(default_factory=list)  # signal, hung, other: with the mutation
    seconds: float = 0.0

    def add(self, case: Case, outcome: str, detail: str) -> None:
        self.outcomes[outcome] += 1
        if outcome == REFUSED:
            self.reasons[re.sub(r"\d+", "N", detail)[:160]] += 1
        elif outcome != RAN:
            self.failures.append(f"{outcome} (case {case.index}: {case.what}): {detail[:300]}")

    def summary(self) -> str:
        total = sum(self.outcomes.values())
        return f"{total} cases: " + ", ".join(f"{k} {self.outcomes[k]}" for k in OUTCOMES)


def classify(rc: int) -> str:
    if rc == 0:
        return RAN
    if rc in (1, 2):
        return REFUSED
    if rc < 0 or rc >= 128:
        return SIGNAL
    return OTHER


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# ---------------------------------------------------------------- targets --
def run_emlx(cases_: list[Case], workdir: Path, timeout: float = 10.0, program: Path | None = None) -> Report:
    """`program`: the cases are mutants of its .ptd, given with --data."""
    from executorch_mlx._runtime_library import runner_binary

    runner = str(runner_binary())
    path = workdir / ("emlx.ptd" if program else "emlx.pte")
    command = [runner, str(program), "--data", str(path)] if program else [runner, str(path)]
    report = Report()
    start = time.perf_counter()
    for case in cases_:
        path.write_bytes(case.data)
        try:
            p = subprocess.run(command + ["--prompt-ids", PROMPT_IDS, "--max-new-tokens", NEW_TOKENS],
                               capture_output=True, text=True, errors="replace", timeout=timeout)
            outcome = classify(p.returncode)
            detail = _last_line(p.stderr) if p.returncode else ""
            if outcome == SIGNAL:
                detail = f"exit {p.returncode}: {detail}"
        except subprocess.TimeoutExpired:
            outcome, detail = HUNG, f"over {timeout} s"
        report.add(case, outcome, detail)
    report.seconds = time.perf_counter() - start
    return report


def _python_target(target: str, pte: str, folder: str, data: str | None = None) -> int:
    """One case, in the forked child: the exit code it gives (`data`: the
    program's .ptd, for LLMRunner)."""
    if target == "LLMRunner":
        from executorch_mlx.llm.run.runner import LLMRunner

        try:
            LLMRunner(pte, folder, data_path=data).generate(PROMPT, max_new_tokens=int(NEW_TOKENS))
        except (ValueError, RuntimeError, OSError) as e:
            print(f"{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
            return 1
        return 0
    from executorch_mlx import cli

    if target == "generate":
        return cli.main(["generate", pte, "--tokenizer", folder, "--prompt", PROMPT,
                         "--max-new-tokens", NEW_TOKENS])
    return cli.main(["inspect", pte])


def _spawn_command(target: str, pte: str, folder: str, data: str | None = None) -> list[str]:
    cli = [sys.executable, "-m", "executorch_mlx.cli"]
    if target == "generate":
        return cli + ["generate", pte, "--tokenizer", folder, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS]
    if target == "inspect":
        return cli + ["inspect", pte]
    code = ("import sys\nfrom executorch_mlx.llm.run.runner import LLMRunner\n"
            "try:\n    LLMRunner(sys.argv[1], sys.argv[2], data_path=(sys.argv[3:] or [None])[0]).generate(\n"
            "        %r, max_new_tokens=%s)\n"
            "except (ValueError, RuntimeError, OSError) as e:\n    sys.exit(f'{type(e).__name__}: {e}')\n"
            % (PROMPT, NEW_TOKENS))
    return [sys.executable, "-c", code, pte, folder] + ([data] if data else [])


def _fork_case(target: str, pte: str, folder: str, log: Path, timeout: float,
               data: str | None = None) -> tuple[int | None, str]:
    """Runs one case in a forked child: (its exit code, negative for a
    signal; None if it ran over `timeout`) and its last stderr line."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = UNCAUGHT
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(fd, 2)
            # Python's own streams too: a caller's may not be on fds 1 and 2 (pytest's capture).
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            # A crash's traceback goes to the case's log, not to the caller's terminal (pytest's faulthandler).
            faulthandler.enable(file=sys.stderr)
            code = _python_target(target, pte, folder, data)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported as OTHER, with its traceback
            import traceback

            traceback.print_exc()
            code = UNCAUGHT
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None, ""
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return rc, _last_line(log.read_text(errors="replace"))


def run_python(target: str, cases_: list[Case], folder: Path, workdir: Path, timeout: float = 10.0,
               spawn: bool = False, program: Path | None = None) -> Report:
    """Forks from this process unless `spawn`: call it from a process that has
    only imported (a server), never one that has run programs or torch ops
    (a forked child gets no copies of their threads). `program`: the cases
    are mutants of its .ptd (LLMRunner only)."""
    if not spawn:
        import executorch_mlx  # noqa: F401  imported once, before any fork
        from executorch_mlx import cli, inspector  # noqa: F401
        from executorch_mlx.llm.run import runner  # noqa: F401

        if target == "inspect":  # it reads a .pte with ExecuTorch's export-side parser
            from executorch.exir._serialize._program import deserialize_pte_binary  # noqa: F401

            from executorch_mlx.lowering import registry  # noqa: F401
    path = workdir / f"{target}.{'ptd' if program else 'pte'}"
    pte, data = (str(program), str(path)) if program else (str(path), None)
    log = workdir / f"{target}.stderr"
    report = Report()
    start = time.perf_counter()
    for case in cases_:
        path.write_bytes(case.data)
        if spawn:
            try:
                p = subprocess.run(_spawn_command(target, pte, str(folder), data), capture_output=True, text=True,
                                   errors="replace", timeout=timeout)
                rc, detail = p.returncode, _last_line(p.stderr)
                escaped = "Traceback (most recent call last)" in p.stderr
            except subprocess.TimeoutExpired:
                rc, detail = None, ""
        else:
            rc, detail = _fork_case(target, pte, str(folder), log, timeout, data)
            escaped = False
        if rc is None:
            report.add(case, HUNG, f"over {timeout} s")
            continue
        outcome = classify(rc)
        if (escaped if spawn else target != "LLMRunner" and rc == 1):
            outcome = OTHER  # an escaped exception (the CLI's own errors exit 2)
        report.add(case, outcome, f"exit {rc}: {detail}" if outcome in (SIGNAL, OTHER) else detail)
    report.seconds = time.perf_counter() - start
    return report


def run_all(pte: Path, folder: Path, counts: dict[str, int], seed: int = 0, timeout: float = 10.0,
            spawn: bool = False, external: Path | None = None) -> dict[str, Report]:
    """{target: report} for `counts[target]` mutants each; `external`: the
    program whose .ptd (beside it) the DATA_TARGETS mutate."""
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        for target in TARGETS:
            n = counts.get(target, 0)
            if not n:
                continue
            program = external if target in DATA_TARGETS else None
            if target in DATA_TARGETS and external is None:
                raise ValueError(f"{target} needs a program exported with external weights")
            data = (program.with_suffix(".ptd") if program else pte).read_bytes()
            mutants = cases(data, n, seed, target)
            if target.startswith(EMLX):
                reports[target] = run_emlx(mutants, Path(tmp), timeout, program)
            else:
                reports[target] = run_python(target.split()[0], mutants, folder, Path(tmp), timeout, spawn, program)
    return reports


if __name__ == "__main__" and sys.argv[1:2] == ["export"]:
    export_program(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
