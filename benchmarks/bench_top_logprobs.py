#!/usr/bin/env python3
"""What `export --top-logprobs 20` costs a decode step, one run.

Writes bench_llm.py's "large" folder (~104M parameters, vocabulary 32000),
exports it twice with `--quantize int4` (the output layer stays float32)
and `--logprobs`, once with the 20 most likely tokens of each step, and
decodes the same 64-token prompt with both in alternating rounds (64
tokens, temperature 0.8, a seed per round). Prints each round's decode
tokens/s and the median ratio, with top logprobs over without.

    .venv/bin/python benchmarks/bench_top_logprobs.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench_llm import load_average, machine, write_folder  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from executorch_mlx.llm import ExportOptions, LLMRunner, export_llm

    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "large", False, None, None)
        runners = {k: LLMRunner(export_llm(folder, Path(tmp) / f"top{k}.pte",
                                           ExportOptions(max_context=256, quantize="int4", logprobs=True,
                                                         top_logprobs=k),
                                           progress=None)) for k in (0, 20)}
        prompt = list(range(5, 69))
        speed = {k: [] for k in runners}
        for r in range(args.rounds):
            for k, runner in runners.items():
                result = runner.generate(prompt, max_new_tokens=64, temperature=0.8, seed=r)
                speed[k].append(result.decode_tokens_per_s)
                print(f"round {r}, top logprobs {k:2d}: decode {speed[k][-1]:.1f} tokens/s", flush=True)
    ratio = statistics.median(speed[20]) / statistics.median(speed[0])
    print(f"top logprobs 20 / none: {ratio:.2f}x decode; load average at end: {load_average()}")


if __name__ == "__main__":
    main()
