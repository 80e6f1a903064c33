#!/usr/bin/env python3
"""Fuzzes the .pte container (issue 16): byte mutations anywhere in a real
LLM program (header, FlatBuffer, segments, weights), each run in its own
process by emlx_runner, LLMRunner and `executorch-mlx generate`/`inspect`,
and prints what happened per target.

    .venv/bin/python scripts/fuzz_container.py [--emlx 3000] [--llmrunner 0] [--generate 250]
        [--inspect 250] [--emlx-ptd 500] [--llmrunner-ptd 0] [--seed 0] [--timeout 10] [--spawn]
        [--program PTE --folder DIR] [--external PTE] [--reasons 15]

The program is a tiny Llama exported at max context 64 from a seeded folder
(tests/container_fuzz.py: the mutations, targets and outcomes), so runs
repeat. The --*-ptd targets mutate the weights file of the same Llama
exported with --external-weights (or of --external PTE), not the program.
Outcomes: ran (exit 0), refused (exit 1-2, an error), signal, hung
(over --timeout), other (an escaped Python exception or an odd exit code).
Python targets run forked from one server process (--spawn: a new
interpreter per case, ~8 s of imports each). Exits 1 on any signal, hang
or other.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import container_fuzz as cf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emlx", type=int, default=3000)
    ap.add_argument("--llmrunner", type=int, default=0)
    ap.add_argument("--generate", type=int, default=250)
    ap.add_argument("--inspect", type=int, default=250)
    ap.add_argument("--emlx-ptd", type=int, default=500, help="mutants of the .ptd through emlx_runner")
    ap.add_argument("--llmrunner-ptd", type=int, default=0, help="mutants of the .ptd through LLMRunner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--spawn", action="store_true", help="a new Python per case instead of a fork")
    ap.add_argument("--program", type=Path, help="mutate this .pte (default: export the tiny Llama)")
    ap.add_argument("--folder", type=Path, help="its model folder (the tokenizer)")
    ap.add_argument("--external", type=Path, help="a program exported with --external-weights, its .ptd beside it "
                                                  "(default: export the tiny Llama so)")
    ap.add_argument("--reasons", type=int, default=15, help="how many of the commonest refusal reasons to print")
    args = ap.parse_args()

    counts = {cf.EMLX: args.emlx, "LLMRunner": args.llmrunner, "generate": args.generate, "inspect": args.inspect,
              cf.DATA_TARGETS[0]: args.emlx_ptd, cf.DATA_TARGETS[1]: args.llmrunner_ptd}
    with tempfile.TemporaryDirectory() as tmp:
        # exported in a subprocess: this one forks the Python cases and must not have run torch
        if args.program:
            pte, folder = args.program, args.folder
        else:
            pte, folder = cf.export_program_in_subprocess(tmp, args.seed)
        external = args.external
        if external is None and (args.emlx_ptd or args.llmrunner_ptd):
            external, _ = cf.export_program_in_subprocess(tmp, args.seed, external=True)
        print(f"{pte}: {pte.stat().st_size} bytes, seed {args.seed}, timeout {args.timeout} s"
              f"{', spawn' if args.spawn else ''}")
        if external is not None:
            print(f"{external.with_suffix('.ptd')}: {external.with_suffix('.ptd').stat().st_size} bytes")
        reports = cf.run_all(pte, folder, counts, args.seed, args.timeout, args.spawn, external)
    bad = 0
    for target, report in reports.items():
        print(f"{target}: {report.summary()} ({report.seconds:.0f} s)")
        for reason, count in report.reasons.most_common(args.reasons):
            print(f"  {count:6d}  {reason}")
        for line in report.failures:
            print(f"  {line}")
        bad += len(report.failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
