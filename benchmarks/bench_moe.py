"""Mixture-of-experts: prefill and decode of a Qwen3-MoE-shaped model, ours
against llama.cpp on the same weights, in one run.

    PYTHONPATH=<llama-cpp-python> .venv/bin/python benchmarks/bench_moe.py --llama-cpp SRC
    .venv/bin/python benchmarks/bench_moe.py --variants int4 int8     # ours only

The folder (random weights, ~288M parameters) is issue #37's: 8 layers,
hidden 1024, 32 experts of width 256, 4 chosen a token, untied embeddings,
a 32000-token vocabulary. Each variant is exported once; with `--llama-cpp
SRC` (a llama.cpp source tree, as bench_state_layers.py takes it) the folder
is also converted by llama.cpp's own converter and quantized by it (Q8_0 /
Q4_0 for our int8 / int4) and run by llama-cpp-python at 2 threads. The
files are written by processes of their own, and each engine and format
then runs in a worker of its own, as in bench_llm.py (whose workers, calls
and tables these are): every repetition prefills a 64-token prompt and
decodes `--decode` steps, greedy and sampled, with each program in turn.
(The tables' share of the memory bound counts every expert's bytes, where
a decode step reads the chosen experts' only.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.argv[1:2] == ["--gguf"]:
    import llama_cpp  # noqa: F401  (before torch, as bench_state_layers.py says)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import Engine, bandwidth, llama_cpp_file, load_average, machine, measure  # noqa: E402
from bench_state_layers import llama_cpp_gguf, save_random_folder  # noqa: E402

VOCAB = 32000


def write_folder(path: Path) -> Path:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=256,
                            num_experts=32, num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return save_random_folder(cfg, path, "qwen3_moe")


def write_gguf(folder: str, variant: str, src: str, out: str) -> int:
    """llama.cpp's converter and quantizer (bench_state_layers.llama_cpp_gguf),
    in a process of their own; the GGUF linked where the worker loads it."""
    os.link(llama_cpp_gguf(Path(folder), variant, Path(src)), out)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--gguf"]:
        return write_gguf(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", type=Path, metavar="SRC", help="also run llama.cpp, converting with SRC's converter")
    args = ap.parse_args()
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    args.prompt_len, args.max_context, args.bandwidth = 64, 64 + args.decode + 1, bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "qwen3_moe")
        out = Path(tmp) / "programs"
        out.mkdir()
        engines = []
        try:
            for variant in args.variants:  # (those started are closed if a later one fails)
                engines.append(Engine("ours", variant, folder, out, args.max_context))
                if args.llama_cpp:
                    gguf = llama_cpp_file(out, variant)
                    subprocess.run([sys.executable, __file__, "--gguf", str(folder), variant, str(args.llama_cpp),
                                    str(gguf)], check=True)
                    engines.append(Engine("llama.cpp", variant, folder, out, args.max_context, prepare=False))
            measure("Qwen3-MoE", args, engines)
        finally:
            for e in engines:
                e.close()
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
