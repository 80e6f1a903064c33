#!/usr/bin/env python3
"""Fuzzes the runtime with hostile delegate blobs, in worker processes that
may crash or hang without ending the run, and prints what happened.

    .venv/bin/python scripts/fuzz_blobs.py [--structured 10000] [--bytes 10000] [--seed 0]
        [--max-changes 2] [--timeout 10] [--memory-budget 4G] [--reasons 25]

--structured: field-aware mutations of a seed graph of every node type of the
schema (fuzzing/graphs.py): 1 to --max-changes fields each, set to
boundary values. --bytes: 1 to 4 random bytes changed in the blobs of two
real programs (an MLP and a sampling head). Each case is loaded and run
through ExecuTorch; its outcome is refused at load, refused at execute, ran,
crashed or hung (over --timeout seconds). Exits 1 on any crash or hang, or
on a refusal without a reason from our runtime.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fuzzing harness


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--structured", type=int, default=10000)
    ap.add_argument("--bytes", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-changes", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--memory-budget", default="4G",
                    help="EMLX_MEMORY_BUDGET of the workers (fixed, so runs compare across machines)")
    ap.add_argument("--reasons", type=int, default=25, help="how many of the commonest refusal reasons to print")
    args = ap.parse_args()

    from fuzzing import runner

    runs = []
    if args.structured:
        cases, templates = runner.structured_cases(args.structured, args.seed, args.max_changes)
        runs.append(("structured", cases, templates))
    if args.bytes:
        templates = runner.real_program_templates()
        runs.append(("bytes", runner.byte_cases(templates, args.bytes, args.seed), templates))
    bad = 0
    for name, cases, templates in runs:
        start = time.perf_counter()
        report = runner.run_cases(cases, templates, timeout=args.timeout, env={"EMLX_MEMORY_BUDGET": args.memory_budget})
        print(f"{name}: {report.summary()} ({time.perf_counter() - start:.0f} s)")
        for reason, count in report.reasons.most_common(args.reasons):
            print(f"  {count:6d}  {reason}")
        for line in report.failures + [f"refused without a reason: {label}" for label in report.unexplained]:
            print(f"  {line}")
        bad += len(report.failures) + len(report.unexplained)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
