"""Cost against the exported context: decode and prefill speed of one model
exported at several max contexts, interleaved in one run.

    .venv/bin/python benchmarks/bench_context.py                         # fp32, contexts 256 2048 4096
    .venv/bin/python benchmarks/bench_context.py --variants fp32 int4 --baseline

For each variant (fp32, int8, int4) and max context, the same random-weight
Llama folder (bench_llm.py's "large" config, ~104M parameters) is exported
once; each repetition then, for every program in turn, prefills a 64-token
prompt and decodes `--decode` greedy steps from position 64, and prefills a
`--long-prompt`-token prompt (where it fits). Printed: medians, and ratios
against max context 256 (decode at the same position) and against the
64-token prompt's per-token rate (prefill).

--baseline adds every program exported the previous way, attending over
the whole static cache (llm/export/attention.py's rewrite off), measured in the
same run: the before/after of that change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import GROUP_SIZE, load_average, machine, write_folder  # noqa: E402


def export(folder: Path, out: Path, variant: str, max_context: int, whole_cache: bool) -> Path:
    from executorch_mlx.llm.export import hf_export
    from executorch_mlx.llm.export.options import ExportOptions

    options = dict(quantize=variant, group_size=GROUP_SIZE, quantize_embedding=True) if variant != "fp32" else {}
    name = f"{variant}-{max_context}{'-whole' if whole_cache else ''}.pte"
    off = mock.patch.object(hf_export, "attend_written_prefix", lambda ep, n: 0) if whole_cache else nullcontext()
    t0 = time.perf_counter()
    with off:
        pte = hf_export.export_llm(folder, out / name, ExportOptions(max_context=max_context, sampling=True, **options),
                                   progress=None)
    print(f"exported {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return pte


def greedy_caller(pte: Path):
    """call(ids, start) -> the greedy next token, through the sampling program."""
    import numpy as np

    from executorch_mlx.llm.run.runner import LLMRunner
    from executorch_mlx.llm.sampler_inputs import program_inputs

    runner = LLMRunner(pte)
    names = runner.input_names[2:]
    given = {"temperature": np.array(0.0, dtype=np.float32), "seed": np.array(0)}

    def call(ids: list[int], start: int) -> int:
        given["position"] = np.array(start)
        sampler = program_inputs(names, {n: runner.input_shapes[n] for n in names}, given)
        return int(runner.method.execute([np.array([ids]), np.arange(start, start + len(ids))] + sampler)[0][0])

    call.runner = runner  # the Method needs its Program alive
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["fp32"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 2048, 4096])
    ap.add_argument("--long-prompt", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--baseline", action="store_true", help="also the whole-cache programs (before)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    import executorch_mlx  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = write_folder(tmp / "large", False, args.layers, args.hidden)
        programs = {}
        for variant in args.variants:
            for ctx in args.contexts:
                for whole in (False, True) if args.baseline else (False,):
                    label = f"{variant} ctx {ctx}" + (" whole cache" if whole else "")
                    programs[label] = (ctx, greedy_caller(export(folder, tmp, variant, ctx, whole)))
        short = [(31 * i + 7) % 32000 for i in range(64)]
        long = [(17 * i + 3) % 32000 for i in range(args.long_prompt)]
        results = {label: {"prefill64": [], "decode": [], "prefill_long": []} for label in programs}
        for label, (_, call) in programs.items():  # warm-up
            call(short[:4], 0)
        for rep in range(args.reps):
            for label, (ctx, call) in programs.items():
                t0 = time.perf_counter()
                token = call(short, 0)
                results[label]["prefill64"].append(len(short) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for i in range(args.decode):
                    token = call([token], len(short) + i)
                results[label]["decode"].append(args.decode / (time.perf_counter() - t0))
                if len(long) < ctx:
                    t0 = time.perf_counter()
                    call(long, 0)
                    results[label]["prefill_long"].append(len(long) / (time.perf_counter() - t0))
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)

    med = {label: {k: statistics.median(v) if v else None for k, v in r.items()} for label, r in results.items()}
    print(f"\nmedians of {args.reps}; decode from position 64; prefill of 64 and {args.long_prompt} tokens\n")
    print(f"| program | prefill 64 tok/s | prefill {args.long_prompt} tok/s | long / 64 | decode tok/s | "
          "decode vs smallest ctx |")
    print("|---|---|---|---|---|---|")
    for label, m in med.items():
        variant, whole = label.split()[0], label.endswith("whole cache")
        base = next((b for lab, b in med.items() if lab.split()[0] == variant and lab.split()[2] ==
                     str(min(args.contexts)) and lab.endswith("whole cache") == whole), m)
        long_rate = "-" if m["prefill_long"] is None else f"{m['prefill_long']:.1f}"
        long_ratio = "-" if m["prefill_long"] is None else f"{m['prefill_long'] / m['prefill64']:.2f}"
        print(f"| {label} | {m['prefill64']:.1f} | {long_rate} | {long_ratio} | {m['decode']:.1f} | "
              f"{m['decode'] / base['decode']:.2f} |")
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
