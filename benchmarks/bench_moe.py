"""Mixture-of-experts: prefill and decode of a Qwen3-MoE-shaped model, ours
against llama.cpp on the same weights, in one run.

    PYTHONPATH=<llama-cpp-python> .venv/bin/python benchmarks/bench_moe.py --llama-cpp SRC
    .venv/bin/python benchmarks/bench_moe.py --variants int4 int8     # ours only

The folder (random weights, ~288M parameters) is issue #37's: 8 layers,
hidden 1024, 32 experts of width 256, 4 chosen a token, untied embeddings,
a 32000-token vocabulary. Each variant is exported once; with `--llama-cpp
SRC` (a llama.cpp source tree, as bench_state_layers.py takes it) the folder
is also converted by llama.cpp's own converter and quantized by it (Q8_0 /
Q4_0 for our int8 / int4) and run by llama-cpp-python at 2 threads. Every
repetition prefills a 64-token prompt and decodes `--decode` greedy steps
with each program in turn. Printed: medians and ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--llama-cpp" in sys.argv:
    import llama_cpp  # noqa: F401  (before torch, as bench_state_layers.py says)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_context import export, greedy_caller  # noqa: E402
from bench_llm import SETTLE_S, load_average, machine  # noqa: E402
from bench_state_layers import greedy_tokens, llama_cpp_caller, llama_cpp_gguf, save_random_folder  # noqa: E402

VOCAB = 32000


def write_folder(path: Path) -> Path:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=256,
                            num_experts=32, num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return save_random_folder(cfg, path, "qwen3_moe")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", type=Path, metavar="SRC", help="also run llama.cpp, converting with SRC's converter")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    max_context = 64 + args.decode + 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "qwen3_moe")
        programs = {}
        for variant in args.variants:
            programs[f"{variant} ours"] = greedy_caller(export(folder, folder, variant, max_context, whole_cache=False))
            if args.llama_cpp:
                gguf = llama_cpp_gguf(folder, variant, args.llama_cpp)
                programs[f"{variant} llama.cpp"] = llama_cpp_caller(gguf, max_context)
        prompt = [(31 * i + 7) % VOCAB for i in range(64)]
        if args.llama_cpp and "fp32" in args.variants:  # the conversion's check: the same weights, the same tokens
            ours, theirs = (greedy_tokens(programs[f"fp32 {who}"], prompt, 8) for who in ("ours", "llama.cpp"))
            print(f"fp32 greedy, 8 tokens: ours {ours}, llama.cpp {theirs}: {'equal' if ours == theirs else 'DIFFER'}")
        results = {label: {"prefill 64": [], "decode": []} for label in programs}
        for call in programs.values():  # warm-up
            call(prompt[:4], 0)
        for rep in range(args.reps):
            for label, call in programs.items():
                t0 = time.perf_counter()
                token = call(prompt, 0)
                results[label]["prefill 64"].append(len(prompt) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for i in range(args.decode):
                    token = call([token], len(prompt) + i)
                results[label]["decode"].append(args.decode / (time.perf_counter() - t0))
                time.sleep(SETTLE_S)  # (llama.cpp's threads spin after their work)
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    print(f"\nmedians of {args.reps}, tok/s\n")
    print("| program | prefill 64 | decode | prefill vs llama.cpp | decode vs llama.cpp |")
    print("|---|---|---|---|---|")
    medians = {label: {k: statistics.median(v) for k, v in r.items()} for label, r in results.items()}
    for label, m in medians.items():
        peer = medians.get(label.replace(" ours", " llama.cpp")) if label.endswith(" ours") else None
        ratios = [f"{m[k] / peer[k]:.2f}x" if peer else "-" for k in ("prefill 64", "decode")]
        print(f"| {label} | {m['prefill 64']:.1f} | {m['decode']:.1f} | " + " | ".join(ratios) + " |")
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
