#!/usr/bin/env python3
"""The whole sampler on the device vs. mlx-lm's sampler vs. the host, one run.

For each batch size B, the same float32 logits [B, V] go through:

  argmax        MLX's own argmax on an mx.array (the baseline: 1.00x)
  ours greedy   a GreedyHead .pte through ExecuTorch's runtime with our plugin
  ours <mode>   a SamplingHead .pte exported with that mode's inputs (seeded,
                per-row parameters); logits enter as an ExecuTorch input
  mlx-lm <mode> mlx_lm.sample_utils.make_sampler / make_logits_processors on
                the same logits as an mx.array (processors, then the sampler;
                its generate's extra logsumexp pass is not counted)
  torch host    torch.topk(50) then top-p 0.9 and multinomial, on the host

Modes (temperature 0.8 in all): temperature alone; top-k 50 + top-p 0.9;
min-p 0.05; repetition penalty 1.1 over a 64-token history. Everything is
measured interleaved in one process, in a shuffled order each round (median
of --repeats); the table prints each as a ratio to MLX argmax, then the
absolute argmax time.

    .venv/bin/python benchmarks/bench_sampling.py [--vocab 128256] [--batch 1 8 32] [--repeats 50]

mlx-lm is a benchmark-only dependency: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import mlx.core as mx
import torch

import executorch_mlx  # noqa: F401  (registers the backend)
from executorch.runtime import Runtime
from executorch_mlx.llm.export.sampling import export_greedy_head, export_sampling_head

from bench_llm import load_average  # beside this script

TEMPERATURE = 0.8
HISTORY = 64
# mode -> (export_sampling_head keywords, runtime inputs besides temperature/seed/position)
MODES = {
    "temperature": ({}, {}),
    "top-k 50 + top-p 0.9": ({"top_k": True, "top_p": True}, {"top_k": 50, "top_p": 0.9}),
    "min-p 0.05": ({"min_p": True}, {"min_p": 0.05}),
    "rep. penalty 1.1": ({"repetition_penalty": True, "history_size": HISTORY}, {"repetition_penalty": 1.1}),
}


class Logits(torch.nn.Module):
    def forward(self, logits):
        return logits


_programs = []  # a Method does not keep its Program alive


def load(buffer: bytes):
    program = Runtime.get().load_program(buffer)
    _programs.append(program)
    return program.load_method("forward")


def mlx_lm_step(mode: str, history: mx.array):
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = {
        "temperature": make_sampler(TEMPERATURE),
        "top-k 50 + top-p 0.9": make_sampler(TEMPERATURE, top_p=0.9, top_k=50),
        "min-p 0.05": make_sampler(TEMPERATURE, min_p=0.05),
        "rep. penalty 1.1": make_sampler(TEMPERATURE),
    }[mode]
    processors = make_logits_processors(repetition_penalty=1.1, repetition_context_size=HISTORY) \
        if mode == "rep. penalty 1.1" else []

    def step(logits: mx.array) -> mx.array:
        for processor in processors:
            logits = processor(history, logits)
        # mlx-lm's generate also normalises (logits - logsumexp) before the
        # sampler; every mode here is shift-invariant, so that pass is left
        # out: the stricter comparison for us
        token = sampler(logits)
        mx.eval(token)
        return token

    return step


def host_topk_topp(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    values, ids = torch.topk(logits / TEMPERATURE, 50, dim=-1)
    probs = torch.softmax(values, dim=-1)
    drop = probs.cumsum(-1) - probs >= 0.9
    probs = probs.masked_fill(drop, 0.0)
    return ids.gather(1, torch.multinomial(probs, 1, generator=gen))[:, 0]


def bench(vocab: int, batch: int, repeats: int) -> dict[str, float]:
    example = torch.zeros(batch, vocab)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
    logits_mx = mx.array(logits.numpy())
    history = torch.randint(0, vocab, (batch, HISTORY), generator=torch.Generator().manual_seed(1))
    history_mx = mx.array(history[0].numpy())  # mlx-lm's processors take one token list
    seeds = torch.arange(batch, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)

    greedy = load(export_greedy_head(Logits(), (example,)).buffer)
    runs = {
        "argmax": lambda step: mx.eval(mx.argmax(logits_mx, axis=-1)),
        "ours greedy": lambda step: greedy.execute([logits]),
    }
    for mode, (export_kwargs, params) in MODES.items():
        method = load(export_sampling_head(Logits(), (example,), seeded=True, per_row=True, **export_kwargs).buffer)
        inputs = [logits, torch.full((batch,), TEMPERATURE), seeds, None]
        for name in ("top_k", "top_p", "min_p", "repetition_penalty"):
            if name in params:
                dtype = torch.int64 if name == "top_k" else torch.float32
                inputs.append(torch.full((batch,), params[name], dtype=dtype))
        if "history_size" in export_kwargs:
            inputs.append(history)

        def run_ours(step, method=method, inputs=inputs):
            inputs[3] = torch.full((batch,), step, dtype=torch.int64)
            return method.execute(inputs)

        runs[f"ours {mode}"] = run_ours
        lm_step = mlx_lm_step(mode, history_mx)
        runs[f"mlx-lm {mode}"] = lambda step, lm_step=lm_step: lm_step(logits_mx)
    runs["torch host topk+topp"] = lambda step: host_topk_topp(logits, gen)

    times = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn(0)
    order = list(runs.items())
    for step in range(repeats):
        # interleaved, so drift hits all alike, in a new order each round, so
        # that no one always runs right after the same neighbour
        random.Random(step).shuffle(order)
        for name, fn in order:
            t0 = time.perf_counter()
            fn(step)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host column's best case on few cores; MLX keeps its threads
    print(f"load average at start: {load_average()}")
    print(f"V={args.vocab}, float32 logits, temperature {TEMPERATURE}, median of {args.repeats} interleaved runs; "
          "ratios to MLX argmax on the same logits (lower is faster)\n")
    results = {batch: bench(args.vocab, batch, args.repeats) for batch in args.batch}
    names = [n for n in results[args.batch[0]] if n != "argmax"]
    print(f"| {'':<34} | " + " | ".join(f"B={b:<4}" for b in args.batch) + " |")
    print(f"|{'-' * 36}|" + "|".join("-" * 8 for _ in args.batch) + "|")
    for name in names:
        print(f"| {name:<34} | " + " | ".join(f"{results[b][name] / results[b]['argmax']:5.2f}x" for b in args.batch) + " |")
    print(f"| {'MLX argmax (ms)':<34} | " + " | ".join(f"{results[b]['argmax'] * 1e3:6.3f}" for b in args.batch) + " |")
    print()
    for mode in MODES:
        wins = [results[b][f"mlx-lm {mode}"] / results[b][f"ours {mode}"] for b in args.batch]
        print(f"{mode}: ours is {' / '.join(f'{w:.2f}x' for w in wins)} as fast as mlx-lm (B = "
              f"{' / '.join(map(str, args.batch))})")
    tk = [results[b]["ours top-k 50 + top-p 0.9"] / results[b]["torch host topk+topp"] for b in args.batch]
    print(f"top-k + top-p: ours / torch host = {' / '.join(f'{r:.2f}' for r in tk)}")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
