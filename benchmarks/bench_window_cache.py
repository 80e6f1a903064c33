"""Memory of sliding-window layers: ring buffers against full-length caches, in one run.

    .venv/bin/python benchmarks/bench_window_cache.py                 # window 512, contexts 2048 8192
    .venv/bin/python benchmarks/bench_window_cache.py --window 1024 --contexts 4096 16384

A Gemma 3 text folder with random weights (Gemma 3 1B's attention shapes:
4 query heads, 1 key/value head of 256; 6 layers, 5 sliding to 1 full as in
Gemma 3; hidden 256) is exported at each max context twice: as export does
now, the sliding-window layers on ring buffers (llm/export/ring_cache.py), and with
the rings off (every layer a full-length cache, as before). Each program then
runs in a fresh process: load, prefill a prompt to `--position`, decode
`--decode` greedy steps. Printed per program: the bytes of its key/value
caches (the delegate's mutable buffers), the process's resident memory after
the run minus before loading, decode tokens/s at that position, and the
ratios ring / full at the same context.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import load_average, machine  # noqa: E402

VOCAB = 32000


def write_folder(path: Path, window: int) -> Path:
    import transformers as tf
    from tokenizers import Tokenizer, models

    config = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=window,
                                 layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                 max_position_embeddings=32768, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def export(folder: Path, out: Path, max_context: int, rings: bool) -> Path:
    from executorch_mlx.llm.export import hf_export
    from executorch_mlx.llm.export.options import ExportOptions

    off = nullcontext() if rings else mock.patch.object(hf_export, "ring_chunk", lambda *a: None)
    t0 = time.perf_counter()
    with off:
        pte = hf_export.export_llm(folder, out / f"{'ring' if rings else 'full'}-{max_context}.pte",
                                   ExportOptions(max_context=max_context), progress=None)
    print(f"exported {pte.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return pte


def cache_bytes(pte: Path) -> int:
    from executorch_mlx.inspector import delegate_graphs

    # keys and values: the 4-d mutable buffers [1, heads, slots, head dim], float32
    return sum(4 * int(torch.tensor(b.shape).prod()) for graph in delegate_graphs(pte.read_bytes())
               for b in graph.mutable_buffers if len(b.shape) == 4)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(pte: Path, position: int, decode: int) -> dict:
    """In this process: resident memory growth of loading and running the program, and decode speed."""
    import executorch_mlx  # noqa: F401  (the runtime plugin)
    from executorch_mlx.llm.run.runner import LLMRunner

    before = rss()
    runner = LLMRunner(pte)
    prompt = [(31 * i + 7) % VOCAB for i in range(position)]
    runner.generate(prompt, max_new_tokens=2)  # prefill, in chunks of the program's largest call
    result = runner.generate(prompt, max_new_tokens=decode)  # the prompt is cached: decode steps only
    return {"rss": rss() - before, "decode": result.decode_tokens_per_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--position", type=int, default=1500, help="prompt length: decode from there")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one program, in a child process
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.measure:
        print(json.dumps(measure(args.measure, args.position, args.decode)))
        return 0
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = write_folder(tmp / "gemma3", args.window)
        for ctx in args.contexts:
            for rings in (True, False):
                pte = export(folder, tmp, ctx, rings)
                child = subprocess.run([sys.executable, __file__, "--measure", str(pte), "--position",
                                        str(min(args.position, ctx - args.decode - 1)), "--decode", str(args.decode)],
                                       capture_output=True, text=True, check=True)
                rows[(ctx, rings)] = {"cache": cache_bytes(pte), **json.loads(child.stdout.splitlines()[-1])}
    mib = 2 ** 20
    print(f"\nwindow {args.window}; decode of {args.decode} steps from position {args.position}\n")
    print("| max context | caches | KV cache MiB | resident growth MiB | decode tok/s | cache ring/full | "
          "resident ring/full | decode ring/full |")
    print("|---|---|---|---|---|---|---|---|")
    for (ctx, rings), r in rows.items():
        full = rows[(ctx, False)]
        ratios = " | ".join(f"{r[k] / full[k]:.2f}" for k in ("cache", "rss", "decode")) if rings else "- | - | -"
        print(f"| {ctx} | {'ring' if rings else 'full'} | {r['cache'] / mib:.1f} | {r['rss'] / mib:.1f} | "
              f"{r['decode']:.1f} | {ratios} |")
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
