#!/usr/bin/env python3
"""On-device sampling vs. greedy argmax vs. host-side sampling, one run.

For each vocabulary size V and batch B, three .pte programs take the same
[B, V] float32 logits and run through ExecuTorch's runtime with our plugin:

  sampler   SamplingHead (seeded, per-row temperature/seed/position) -> ids
  greedy    GreedyHead (argmax)                                      -> ids
  host      logits pass through the delegate and are copied out; then
            torch softmax + multinomial on the host                  -> ids

The three are measured interleaved with torch limited to one thread (the
best case for the host loop). A last column times the host loop again with
torch's default thread pool: on few cores its spinning threads starve MLX's,
which is what a naive host-side loop pays.

Prints median times and the ratios sampler/greedy and sampler/host. Ratios,
not absolute times, are the result: everything is measured in one process.

    .venv/bin/python benchmarks/bench_sampling.py [--repeats 50] [--vocab 32000 128256] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import executorch_mlx  # noqa: F401  (registers the backend)
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from executorch_mlx import MLXPartitioner
from executorch_mlx.llm.sampling import export_greedy_head, export_sampling_head


class Logits(torch.nn.Module):
    def forward(self, logits):
        return logits


class PassThrough(torch.nn.Module):
    def forward(self, logits):
        return logits * 1.0  # one delegate op, so logits cross the delegate boundary


_programs = []  # a Method does not keep its Program alive


def load(buffer: bytes):
    program = Runtime.get().load_program(buffer)
    _programs.append(program)
    return program.load_method("forward")


def bench(vocab: int, batch: int, repeats: int, default_threads: int) -> dict[str, float]:
    example = torch.zeros(batch, vocab)
    sampler = load(export_sampling_head(Logits(), (example,), seeded=True, per_row=True).buffer)
    greedy = load(export_greedy_head(Logits(), (example,)).buffer)
    ep = torch.export.export(PassThrough(), (example,))
    passthrough = load(to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch().buffer)

    logits = torch.randn(batch, vocab) * 3
    temperature = torch.full((batch,), 0.8)
    seeds = torch.arange(batch, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)

    def run_sampler(step):
        return sampler.execute([logits, temperature, seeds, torch.full((batch,), step, dtype=torch.int64)])[0]

    def run_greedy(step):
        return greedy.execute([logits])[0]

    def run_host(step):
        out = passthrough.execute([logits])[0]
        probs = torch.softmax(out / temperature[:, None], dim=-1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    def measure(runs: dict) -> dict[str, float]:
        times = {name: [] for name in runs}
        for fn in runs.values():  # warm-up
            fn(0)
        for step in range(repeats):
            for name, fn in runs.items():  # interleaved, so drift hits all alike
                t0 = time.perf_counter()
                fn(step)
                times[name].append(time.perf_counter() - t0)
        return {name: statistics.median(ts) for name, ts in times.items()}

    torch.set_num_threads(1)
    result = measure({"sampler": run_sampler, "greedy": run_greedy, "host": run_host})
    torch.set_num_threads(default_threads)
    result.update(measure({"host_default_threads": run_host}))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
    print(f"median of {args.repeats} runs each; float32 logits; MLX device: CPU backend; "
          f"host columns: torch 1 thread | torch {default_threads} threads (default)")
    print(f"{'V':>7} {'B':>2} | {'sampler ms':>10} {'greedy ms':>9} {'host ms':>8} {'host(def) ms':>12} | "
          f"{'sampler/greedy':>14} {'sampler/host':>12} {'sampler/host(def)':>17}")
    for vocab in args.vocab:
        for batch in args.batch:
            t = bench(vocab, batch, args.repeats, default_threads)
            print(f"{vocab:>7} {batch:>2} | {t['sampler'] * 1e3:>10.3f} {t['greedy'] * 1e3:>9.3f} "
                  f"{t['host'] * 1e3:>8.3f} {t['host_default_threads'] * 1e3:>12.3f} | "
                  f"{t['sampler'] / t['greedy']:>14.2f} {t['sampler'] / t['host']:>12.2f} "
                  f"{t['sampler'] / t['host_default_threads']:>17.2f}")


if __name__ == "__main__":
    main()
