"""Two or more programs of one model, paired in one process: which decodes faster.

    .venv/bin/python benchmarks/bench_paired.py BASE.pte OTHER.pte [MORE.pte ...] [--reps 30]

This machine's speed drifts by tens of percent over seconds (its phases:
docs/benchmarks.md), so runs of two programs a minute apart compare the
phases as much as the programs. Here every program is loaded in one process
and each repetition runs them back to back: a 64-token greedy prefill, then
32 greedy decode steps (bench_llm.py's call of the program). The ratio of the
base's step time to each other's, taken per repetition and then the median,
compares them in the same seconds; "wins" counts repetitions where the other
was faster. Use it for two exports of one model: before and after a
lowering change (one runtime: the process loads one build of it).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench_llm import load_average, machine, program_call, run_once

PROMPT = list(range(1, 65))
STEPS = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("programs", type=Path, nargs="+", help="the base program first")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if len(args.programs) < 2:
        ap.error("give at least two programs")
    print(f"machine: {machine()}; load average at start: {load_average()}")
    from executorch_mlx.llm.run.runner import LLMRunner

    calls = [program_call(LLMRunner(p), 0.0) for p in args.programs]
    steps: list[list[float]] = [[] for _ in calls]
    for _ in range(args.reps):
        for call, times in zip(calls, steps):
            times.append(run_once(call, PROMPT, STEPS)[1])
    print(f"\n{args.reps} repetitions, each: a {len(PROMPT)}-token prefill, then {STEPS} greedy decode steps\n")
    print("| program | decode tok/s (median) | speed vs the first (median of pairs) | mean | wins |")
    print("|---|---|---|---|---|")
    for path, times in zip(args.programs, steps):
        ratios = [a / b for a, b in zip(steps[0], times)]
        wins = sum(r > 1 for r in ratios)
        print(f"| {path} | {1 / statistics.median(times):.1f} | {statistics.median(ratios):.3f}x | "
              f"{statistics.mean(ratios):.3f}x | {wins}/{len(ratios)} |")
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
