#!/usr/bin/env python3
"""Runs each hostile blob of executorch_mlx.fuzzing.hostile in its own process
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

CHILD = r"""
import json, resource, sys, time
import executorch_mlx
from executorch.runtime import Runtime
from executorch_mlx._runtime_library import last_error
from executorch_mlx.fuzzing import hostile, sketch
pte = sketch.wrap(hostile.CASES[sys.argv[1]]())
report = {}
def done(outcome, **kw):
    report.update(outcome=outcome, **kw,
                  peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))
    print(json.dumps(report), flush=True)
    sys.exit(0)
t = time.perf_counter()
try:
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
except RuntimeError:
    done("refused at load", load_s=round(time.perf_counter() - t, 3), reason=last_error())
report["load_s"] = round(time.perf_counter() - t, 3)
calls = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    try:
        out = method.execute(list(sketch.INPUTS))
    except RuntimeError:
        done("refused at execute", reason=last_error())
    calls.append(round(time.perf_counter() - t, 4))
done("ran", call_s=calls, result=float(out[0]))
"""


def main() -> int:
    from executorch_mlx.fuzzing import hostile

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
