#!/usr/bin/env python3
"""Runs each hostile blob of fuzzing/hostile.py in its own process
and prints what happened: refused (at load or execute, with the reason), ran,
crashed (signal) or timed out, with load and call times and peak memory.
Exits 1 unless every REFUSED case is refused and every FAST one runs, load
and calls, within --fast-s seconds.

    .venv/bin/python scripts/hostile_blobs.py [--timeout 60] [--calls 3] [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fuzzing harness

# One case in a child process, through the harness (fuzzing/runner.py).
CHILD = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from fuzzing.hostile import measure_main; measure_main()"


def main() -> int:
    from fuzzing import hostile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=list(hostile.CASES))
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--fast-s", type=float, default=1.0)
    args = ap.parse_args()
    bad = 0
    for name in args.cases:
        try:
            res = subprocess.run([sys.executable, "-c", CHILD, name, str(args.calls)], capture_output=True,
                                 text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name:24s} TIMEOUT after {args.timeout:.0f} s")
            bad += 1
            continue
        if res.returncode != 0:
            print(f"{name:24s} CRASHED (exit {res.returncode}) {res.stderr.strip()[-300:]}")
            bad += 1
            continue
        report = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{name:24s} {json.dumps(report)}")
        if name in hostile.FAST:
            bad += report["outcome"] != "ran" or report["load_s"] + sum(report["call_s"]) > args.fast_s
        else:
            bad += report["outcome"] == "ran"
    print(f"{len(args.cases) - bad} of {len(args.cases)} as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
