"""A call after a pause: the same 64-token prefill and the 32 greedy decode
steps after it, run right after the previous call and after pauses of 10,
60 and 500 ms, in one process, interleaved.

    .venv/bin/python benchmarks/bench_pauses.py                  # int4, 8 rounds
    .venv/bin/python benchmarks/bench_pauses.py --variant fp32 --rounds 5
    .venv/bin/python benchmarks/bench_pauses.py --config small   # per-step costs dominate

A chat's turns and a server's requests come after pauses. Each call's graph
is built on the caller's thread while MLX's stream thread runs it; after a
pause, Linux can wake the one onto the other's CPU (an idle virtual CPU can
look busy to it), and both then share one core (our pool, docs/lowering.md):
for milliseconds in a prefill, and for whole decode runs of a small model.
The ratio of each pause's median to the back-to-back median, measured in
the same run, should be 1.00.

A Llama config of bench_llm.py ("large": ~104M parameters; "small": 2
layers, hidden 256; random weights), greedy, max context 256; bench_llm.py's
call of the program.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_llm import GROUP_SIZE, VARIANTS, load_average, machine, program_call, run_once, write_folder

PROMPT = [(31 * i + 7) % 32000 for i in range(64)]
PAUSES_S = (0.0, 0.01, 0.06, 0.5)
STEPS = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="int4", choices=[v for v in VARIANTS if v != "bf16"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--config", default="large", choices=["large", "small"])
    args = ap.parse_args()
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / args.config, small=args.config == "small", layers=None, hidden=None)
        quantized = dict(quantize=args.variant, group_size=GROUP_SIZE, quantize_embedding=True)
        pte = export_llm(folder, Path(tmp) / f"ours-{args.variant}.pte",
                         ExportOptions(max_context=256, **(quantized if args.variant != "fp32" else {})), progress=None)
        from executorch_mlx.llm.run.runner import LLMRunner

        call = program_call(LLMRunner(pte), 0.0)

        def run() -> tuple[float, float]:  # (prefill ms, mean decode step ms)
            prefill, step, _ = run_once(call, PROMPT, STEPS)
            return prefill * 1e3, step * 1e3

        run()  # warm-up
        ms = {pause: [] for pause in PAUSES_S}
        for r in range(args.rounds):
            for pause in PAUSES_S[r % len(PAUSES_S):] + PAUSES_S[:r % len(PAUSES_S)]:  # rotating order
                run()  # the call the pause follows
                time.sleep(pause)
                ms[pause].append(run())
    base = [statistics.median(part) for part in zip(*ms[0.0])]
    print(f"\n{args.config} {args.variant}: a 64-token prefill, then {STEPS} decode steps; median of {args.rounds} "
          "rounds\n")
    print("| pause before the call | prefill ms | decode step ms | every round (prefill / step) | vs back-to-back |")
    print("|---|---|---|---|---|")
    for pause, runs in ms.items():
        prefill, step = (statistics.median(part) for part in zip(*runs))
        rounds = " ".join(f"{p:.0f}/{d:.2f}" for p, d in runs)
        print(f"| {pause * 1e3:.0f} ms | {prefill:.1f} | {step:.3f} | {rounds} | {prefill / base[0]:.2f}x, "
              f"{step / base[1]:.2f}x |")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
