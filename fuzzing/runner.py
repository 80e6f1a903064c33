"""Runs fuzz cases through ExecuTorch in worker processes.

A case is a template program with its delegate blob swapped for another of
the same length. Workers load and execute cases one after another and
report each outcome; a worker that dies (a crash) or stalls past the
timeout (a hang) is counted against its case and replaced, so one bad case
never ends the run.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import re
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from executorch_mlx.serialization import ir
from executorch_mlx.serialization.sampler_params import ROW_PARAMS
from . import graphs, mutate, sketch
from .sketch import Template

LOAD, EXECUTE, RAN, CRASHED, HUNG = "refused at load", "refused at execute", "ran", "crashed", "hung"


@dataclass(frozen=True)
class Case:
    template: str  # key of the template program
    blob: bytes  # the delegate blob to run (same length as the template's)
    label: str  # what was changed


@dataclass
class Report:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    by_label: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (outcome, reason)
    reasons: collections.Counter = field(default_factory=collections.Counter)  # refusal messages, numbers elided
    unexplained: list[str] = field(default_factory=list)  # refused with no reason from our runtime
    failures: list[str] = field(default_factory=list)  # crashed or hung, with what was changed

    def summary(self) -> str:
        total = sum(self.outcomes.values())
        parts = ", ".join(f"{k} {self.outcomes[k]}" for k in (LOAD, EXECUTE, RAN, CRASHED, HUNG))
        return f"{total} cases: {parts}"


# ---------------------------------------------------------------- cases --
def structured_cases(count: int, seed: int = 0, max_changes: int = 1,
                     names: list[str] | None = None) -> tuple[list[Case], dict[str, Template]]:
    """`count` mutated graphs, spread evenly over every seed graph (graphs.py)."""
    rng = random.Random(seed)
    names = names or list(graphs.GRAPHS)
    cases = []
    for k, name in enumerate(names):
        base = graphs.GRAPHS[name]()
        share = count // len(names) + (k < count % len(names))
        for changes in mutate.sample(base, rng, share, max_changes):
            label = f"{name}: " + "; ".join(m.describe() for m in changes)
            cases.append(Case("sketch", sketch.pad(ir.serialize(mutate.apply(base, *changes))), label))
    return cases, {"sketch": sketch.sketch_template()}


def seed_cases(names: list[str] | None = None) -> tuple[list[Case], dict[str, Template]]:
    """Every seed graph unmutated (each must run)."""
    names = names or list(graphs.GRAPHS)
    cases = [Case("sketch", sketch.pad(ir.serialize(graphs.GRAPHS[n]())), n) for n in names]
    return cases, {"sketch": sketch.sketch_template()}


def byte_cases(templates: dict[str, Template], count: int, seed: int = 0) -> list[Case]:
    """`count` copies of the templates' blobs with 1 to 4 random bytes
    changed (past the root offset and file identifier), spread evenly."""
    rng = random.Random(seed)
    keys = sorted(templates)
    cases = []
    for i in range(count):
        key = keys[i % len(keys)]
        data = bytearray(templates[key].placeholder)
        changed = []
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(8, len(data))
            data[at] = rng.randrange(256)
            changed.append(f"{at}={data[at]}")
        cases.append(Case(key, bytes(data), f"{key} bytes " + ",".join(changed)))
    return cases


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 40)

    def forward(self, tokens):
        return self.proj(self.emb(tokens))


def real_program_templates() -> dict[str, Template]:
    """Two real programs: an MLP, and a sampling head with every sampler
    parameter on (their blobs are what byte_cases mutates)."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx.llm.export.sampling import export_sampling_head, sampler_examples
    from executorch_mlx.partitioner import MLXPartitioner

    with torch.random.fork_rng():  # the same weights, so the same blobs (constant names hash them), every run
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
        head_model = _TinyLM().eval()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))

    def lower_mlp():
        ep = torch.export.export(mlp, (x,))
        return to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch().buffer

    tokens = torch.tensor([[1, 5, 7], [2, 3, 9]])
    flags = dict.fromkeys(ROW_PARAMS, True)
    params = dict(history_size=4, logit_bias_size=2)

    def lower_head():
        return export_sampling_head(head_model, (tokens,), per_row=True, **flags, **params).buffer

    examples = sampler_examples(2, seeded=True, per_row=True, params=tuple(flags), **params)
    templates = {}
    for key, lower, inputs in (("mlp", lower_mlp, (x,)), ("sampling_head", lower_head, (tokens, *examples.values()))):
        pte, blob = sketch.capture_blob(lower)
        templates[key] = Template(pte, blob, inputs)
    return templates


# --------------------------------------------------------------- running --
# Where the worker imports this package from (the repository root).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cases(cases: list[Case], templates: dict[str, Template], timeout: float = 10.0,
              env: dict[str, str] | None = None, worker: str = "fuzzing.runner",
              path: tuple[str, ...] = ()) -> Report:
    """Runs every case in worker processes (with `env` added to their
    environment); never raises for a case. `worker` is the module whose
    worker_main() the processes run (importable from `path` or the root)."""
    report = Report()
    code = (f"import sys; sys.path[:0] = {[*path, _ROOT]!r}; "
            f"from {worker} import worker_main; worker_main()")
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = os.path.join(tmp, "cases.pkl")
        with open(cases_path, "wb") as f:
            pickle.dump((templates, cases), f)
        pos = 0
        while pos < len(cases):
            pos = _run_worker(code, cases_path, pos, cases, timeout, report, os.path.join(tmp, "stderr"), env)
    return report


def _record(report: Report, case: Case, outcome: str, reason: str = "") -> None:
    report.outcomes[outcome] += 1
    report.by_label[case.label] = (outcome, reason)
    if outcome in (LOAD, EXECUTE):
        if reason:
            report.reasons[re.sub(r"-?\d+(\.\d+)?", "N", reason)[:110]] += 1
        else:
            report.unexplained.append(case.label)
    elif outcome in (CRASHED, HUNG):
        report.failures.append(f"{outcome}: {case.label} {reason}".rstrip())


def _run_worker(code: str, path: str, start: int, cases: list[Case], timeout: float, report: Report,
                err_path: str, env: dict[str, str] | None) -> int:
    """Runs cases from `start` in one worker; returns where the next worker starts."""
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, path, str(start)], stdout=subprocess.PIPE,
                                stderr=err, text=True, bufsize=1, env={**os.environ, **(env or {})})
    current, started = None, 0.0
    try:
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if not line:  # the worker is gone
                    proc.wait()
                    if current is None:
                        if proc.returncode != 0:
                            raise RuntimeError(f"fuzz worker failed before its first case: {_tail(err_path)}")
                        return len(cases)
                    _record(report, cases[current], CRASHED, f"(exit {proc.returncode}) {_tail(err_path)}")
                    return current + 1
                tag, _, rest = line.rstrip("\n").partition(" ")
                if tag == "B":
                    current, started = int(rest), time.monotonic()
                elif tag == "E":
                    index, outcome, reason = rest.split("\t", 2)
                    _record(report, cases[int(index)], outcome, reason)
                    current = None
            if current is not None and time.monotonic() - started > timeout:
                proc.kill()
                proc.wait()
                _record(report, cases[current], HUNG, f"(over {timeout:.0f} s)")
                return current + 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        lines = f.read().decode(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:])[-400:]


@dataclass
class Outcome:
    outcome: str  # LOAD, EXECUTE or RAN
    reason: str = ""  # our runtime's, for a refusal
    load_s: float = 0.0
    call_s: list[float] = field(default_factory=list)
    result: object = None  # the last call's first output


def run_program(pte: bytes, inputs: list, calls: int = 1) -> Outcome:
    """Loads `pte` and calls its forward `calls` times, in this process."""
    import executorch_mlx  # noqa: F401  (registers the backend)
    from executorch.runtime import Runtime

    from executorch_mlx._runtime_library import clear_last_error, last_error

    clear_last_error()
    t = time.perf_counter()
    try:
        program = Runtime.get().load_program(pte)  # outlives its method
        method = program.load_method("forward")
    except RuntimeError:
        return Outcome(LOAD, last_error(), time.perf_counter() - t)
    done = Outcome(RAN, load_s=time.perf_counter() - t)
    for _ in range(calls):
        t = time.perf_counter()
        try:
            done.result = method.execute(list(inputs))[0]
        except RuntimeError:
            done.outcome, done.reason = EXECUTE, last_error()
            return done
        done.call_s.append(time.perf_counter() - t)
    return done


def worker_main(before_case=None) -> None:
    """In a worker process: run cases from argv[2] on, reporting each on stdout.
    `before_case(case)` runs first for each case (a test's worker makes some
    crash or hang through it)."""
    with open(sys.argv[1], "rb") as f:
        templates, cases = pickle.load(f)
    for index in range(int(sys.argv[2]), len(cases)):
        case = cases[index]
        template = templates[case.template]
        print(f"B {index}", flush=True)
        if before_case is not None:
            before_case(case)
        done = run_program(template.with_blob(case.blob), template.inputs)
        reason = done.reason.replace("\t", " ").replace("\n", " ")
        print(f"E {index}\t{done.outcome}\t{reason}", flush=True)
