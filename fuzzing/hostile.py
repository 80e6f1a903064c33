"""Small blobs that once crashed, stalled or exhausted the process (issue 7).

Each builds a graph with `Sketch`. The runtime must refuse every one of
REFUSED with a clear error at load, and live; FAST ones are valid and must
load and run quickly.
"""

from __future__ import annotations

import sys

from executorch_mlx.serialization import ir
from .sketch import I64, Sketch, sizes


def zero_stride() -> ir.Graph:
    """MLX divides by slice strides: SIGFPE on 0."""
    s = Sketch()
    return s.finish(s.op(ir.SliceNode, a=s.x, start=[0, 0, 0], stop=[2, 3, 4], strides=[1, 0, 1]), 3)


def dimension_beyond_int32() -> ir.Graph:
    """MLX's shapes are int32: full([2**32 + 5]) ran as 5 elements."""
    s = Sketch()
    return s.finish(s.full([2**32 + 5], 1.0), 1)


def fill_8gib() -> ir.Graph:
    """An 8 GiB fill on every call."""
    s = Sketch()
    return s.finish(s.full([2, 2**30], 1.0), 2)


def matmul_8gib() -> ir.Graph:
    """[2^15, 1] @ [1, 2^16]: an 8 GiB product from two tiny operands."""
    s = Sketch()
    a, b = s.full([2**15, 1], 1.0), s.full([1, 2**16], 1.0)
    return s.finish(s.op(ir.MatmulNode, a=a, b=b), 2)


def arange_16gib() -> ir.Graph:
    """arange(0, 2^31 - 1) in int64: 16 GiB."""
    s = Sketch()
    return s.finish(s.op(ir.ArangeNode, start=0.0, stop=float(2**31 - 1), step=1.0, dtype=I64), 1)


def random_bits_rows() -> ir.Graph:
    """Seeded random bits for 2^20 rows: valid (8 MiB), but a per-row loop
    once took 36 s to load it."""
    s = Sketch()
    bits = s.op(ir.RandomBitsNode, shape=sizes(2**20, 2), seed=s.lit(7, I64), position=s.lit(0, I64), width=4)
    return s.finish(bits, 2)


def value_slots_2_24() -> ir.Graph:
    """x + y claiming 2^24 value slots: every call allocated them all."""
    s = Sketch()
    g = s.finish(s.op(ir.AddNode, a=s.x, b=s.y), 3)
    g.num_values = 2**24
    return g


REFUSED = {f.__name__: f for f in (zero_stride, dimension_beyond_int32, fill_8gib, matmul_8gib, arange_16gib,
                                   value_slots_2_24)}
FAST = {f.__name__: f for f in (random_bits_rows,)}
CASES = {**REFUSED, **FAST}


def measure_main() -> None:
    """In a child process: runs CASES[argv[1]] argv[2] times through the
    harness and prints one JSON line (outcome, reason, times, peak memory)."""
    import json
    import resource

    from .runner import RAN, run_program
    from .sketch import INPUTS, wrap

    done = run_program(wrap(CASES[sys.argv[1]]()), list(INPUTS), calls=int(sys.argv[2]))
    report = {"outcome": done.outcome, "load_s": round(done.load_s, 3)}
    if done.outcome == RAN:
        report.update(call_s=[round(t, 4) for t in done.call_s], result=float(done.result))
    else:
        report["reason"] = done.reason
    report["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(report), flush=True)
