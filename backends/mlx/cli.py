"""The `executorch-mlx` command line.

    executorch-mlx demo                 export, lower and run built-in models
    executorch-mlx inspect FILE.pte     print the MLX delegate graphs
    executorch-mlx generate FILE.pte    decode with a SamplingHead program
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def cmd_inspect(args) -> int:
    from .inspector import inspect_pte

    print(inspect_pte(args.pte))
    return 0


def cmd_generate(args) -> int:
    import torch

    from .llm.decode import SampledDecoder

    dec = SampledDecoder(args.pte)
    if args.prompt:
        ids = [int(t) for t in args.prompt.split(",")]
        if len(ids) != dec.window:
            print(f"--prompt needs {dec.window} token ids, got {len(ids)}", file=sys.stderr)
            return 2
        prompt = torch.tensor([ids] * dec.batch, dtype=torch.int64)
    else:
        prompt = torch.zeros(dec.batch, dec.window, dtype=torch.int64)
    seed = args.seed
    if dec.seeded and seed is None:
        seed = 0
    if not dec.seeded and seed is not None:
        print("this program was exported without a seed input; --seed is ignored", file=sys.stderr)
        seed = None
    result = dec.generate(prompt, args.steps, temperature=args.temperature, seed=seed)
    for row in result.tokens.tolist():
        print(" ".join(map(str, row)))
    ms = [t * 1e3 for t in result.step_seconds]
    print(f"{args.steps} steps, median {statistics.median(ms):.3f} ms/step", file=sys.stderr)
    return 0


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def cmd_demo(args) -> int:
    import warnings

    import torch

    # torch.export's own deprecation notice (pytree internals), not actionable here
    warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*", category=FutureWarning)
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from . import MLXPartitioner
    from .inspector import delegate_blobs, undelegated_ops
    from .llm.decode import SampledDecoder
    from .llm.sampling import export_sampling_head
    from .llm.tiny_lm import TinyLM
    from .serialization import ir

    torch.manual_seed(0)
    model = TinyLM().eval()
    batch = 2
    prompt = torch.randint(0, 256, (batch, model.window))

    print("== 1. Lower a small language model (logits out) ==")
    ep = torch.export.export(model, (prompt,))
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    prog = edge.to_executorch()
    for method, i, backend_id, blob in delegate_blobs(prog.buffer):
        g = ir.deserialize(blob)
        kinds = sorted({type(n.op).__name__.removesuffix("Node") for n in g.nodes})
        print(f"delegate {i} of '{method}' -> {backend_id}: {len(g.nodes)} nodes, "
              f"{len(g.constants)} weights; ops: {', '.join(kinds)}")
    print(f"ops left on portable kernels: {undelegated_ops(edge) or 'none'}")
    program = Runtime.get().load_program(prog.buffer)  # must outlive its Method
    method = program.load_method("forward")
    got = method.execute([prompt])[0]
    with torch.no_grad():
        want = model(prompt)
    print(f"max |pte - eager| = {(got - want).abs().max().item():.3g} over {want.numel()} logits")
    print(f"time per run: {_timed(lambda: method.execute([prompt]), 50) * 1e3:.3f} ms (median of 50)")

    print("\n== 2. Sample on the device: SamplingHead, seeded ==")
    sampler = SampledDecoder(export_sampling_head(model, (prompt,), seeded=True, per_row=True).buffer)
    seeds = torch.tensor([42, 43])  # one seed per request
    result = sampler.generate(prompt, args.steps, temperature=0.8, seed=seeds)
    for b, row in enumerate(result.tokens.tolist()):
        print(f"row {b} (seed {int(seeds[b])}): {' '.join(map(str, row))}")
    again = sampler.generate(prompt, args.steps, temperature=0.8, seed=seeds)
    print(f"same seeds again -> identical tokens: {torch.equal(again.tokens, result.tokens)}")
    on_device = statistics.median(result.step_seconds)

    print("\n== 3. The same step with host-side sampling (logits copied out) ==")
    gen = torch.Generator().manual_seed(42)

    def host_step_times() -> list[float]:
        window, times = prompt.clone(), []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = method.execute([window])[0][:, -1, :]
            ids = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=gen)[:, 0]
            times.append(time.perf_counter() - t0)
            window = torch.cat([window[:, 1:], ids[:, None]], dim=1)
        return times

    threads = torch.get_num_threads()
    host_default = statistics.median(host_step_times())
    torch.set_num_threads(1)
    host_single = statistics.median(host_step_times())
    torch.set_num_threads(threads)
    print(f"per step (median of {args.steps}; batch {batch}, vocab 256, window {model.window}):")
    print(f"  on-device sampling                    {on_device * 1e3:8.3f} ms")
    print(f"  host-side sampling, torch {threads} threads   {host_default * 1e3:8.3f} ms")
    print(f"  host-side sampling, torch 1 thread    {host_single * 1e3:8.3f} ms")
    print("  (on few cores, torch's spinning thread pool starves MLX's threads between steps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="executorch-mlx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="export, lower and run built-in models")
    p.add_argument("--steps", type=int, default=32, help="tokens to decode (default 32)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("inspect", help="print the MLX delegate graphs of a .pte")
    p.add_argument("pte")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("generate", help="decode with a SamplingHead .pte (tokens window in, ids out)")
    p.add_argument("pte")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="64-bit seed (seeded programs; default 0)")
    p.add_argument("--steps", type=int, default=16, help="tokens to decode (default 16)")
    p.add_argument("--prompt", default=None, help="comma-separated token ids filling the window (default zeros)")
    p.set_defaults(fn=cmd_generate)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"executorch-mlx {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
