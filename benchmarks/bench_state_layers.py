"""State-layer models: decode far into the context against decode near its
start, and a long prompt's prefill rate against a short one's, in one run.

    .venv/bin/python benchmarks/bench_state_layers.py                    # fp32 and int4, both shapes
    .venv/bin/python benchmarks/bench_state_layers.py --shapes qwen3_5 --variants int4 --reps 5

Two random-weight folders of ~80M parameters (32000-token vocabulary,
hidden 640, 12 layers): Qwen3.5-shaped (three gated delta layers to one full
attention layer) and LFM2-shaped (two short-convolution layers to one
attention layer). Each is exported per variant at max context `--far` +
`--decode` + 1; every repetition then, for every program in turn, prefills
64 tokens and decodes `--decode` greedy steps, prefills `--long` tokens, and
prefills `--far` tokens and decodes `--decode` steps from there. A decode's
rate is one over the median of its steps' times (one slow step, the machine's
noise or the first after a long prefill, does not move it). Printed:
medians over the repetitions, and the two ratios the state layers must hold (issue #36): decode
at position `--far` against position 64 (>= 0.9), and the `--long`-token
prefill's per-token rate against the 64-token one's (>= 0.8: the chunked
form, not a step per token).

With `--llama-cpp SRC` (a llama.cpp source tree: llama-cpp-python's sdist
carries one under vendor/llama.cpp) the same folders also run on llama.cpp
(the bench extra's llama-cpp-python), converted by its own converter
(llama_cpp_convert.py) to F32 and quantized by it to Q8_0 / Q4_0 for our
int8 / int4, in the same table; first its greedy tokens are compared with
ours at fp32 (the conversion's check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--llama-cpp" in sys.argv:
    # before torch: llama-cpp-python's build (OpenMP) loaded after torch crashes the process (SIGSEGV)
    import llama_cpp  # noqa: F401
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_context import export, greedy_caller  # noqa: E402
from bench_llm import SETTLE_S, load_average, machine  # noqa: E402

VOCAB, HIDDEN, LAYERS = 32000, 640, 12


def write_folder(path: Path, shape: str) -> Path:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=10,
                  num_key_value_heads=2, max_position_embeddings=32768, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=True)
    if shape == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**common, intermediate_size=1792, head_dim=64, linear_num_key_heads=4,
                                   linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                   layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4))
    else:
        cfg = tf.Lfm2Config(**common, intermediate_size=2560,
                            layer_types=["conv", "conv", "full_attention"] * (LAYERS // 3))
    return save_random_folder(cfg, path, shape)


def save_random_folder(cfg, path: Path, name: str) -> Path:
    """A folder of `cfg` with random weights (seed 0) and our trained
    vocabulary (for llama.cpp's converter, which reads one; the runs feed
    token ids)."""
    import transformers as tf

    from executorch_mlx.llm.model_folders import BOS, EOS, train_tokenizer

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model.save_pretrained(path)
    tf.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token=BOS, eos_token=EOS).save_pretrained(path)
    return path


LLAMA_CPP_TYPES = {"fp32": None, "int8": "LLAMA_FTYPE_MOSTLY_Q8_0", "int4": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def llama_cpp_gguf(folder: Path, variant: str, src: Path) -> Path:
    """The folder as llama.cpp's converter writes it (F32), quantized by llama.cpp for int8 / int4."""
    import subprocess

    import llama_cpp as lc

    f32 = folder / "llama-f32.gguf"
    if not f32.exists():
        # (Qwen3.5's converter expects multi-token-prediction layers unless told there are none; LFM2's refuses the flag)
        qwen = json.loads((folder / "config.json").read_text())["model_type"].startswith("qwen3_5")
        no_mtp = ["--no-mtp"] if qwen else []
        subprocess.run([sys.executable, str(Path(__file__).with_name("llama_cpp_convert.py")), str(src), str(folder),
                        "--outfile", str(f32), "--outtype", "f32", *no_mtp], check=True, capture_output=True)
    if LLAMA_CPP_TYPES[variant] is None:
        return f32
    out = folder / f"llama-{variant}.gguf"
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, LLAMA_CPP_TYPES[variant])
    if lc.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f32} to {variant}")
    return out


def llama_cpp_caller(gguf: Path, max_context: int, f32_cache: bool = False):
    """call(ids, start) -> llama.cpp's greedy next token (2 threads, as ours;
    its KV cache in float16, its default, or float32 as ours)."""
    import llama_cpp as lc
    import numpy as np

    cache = dict(type_k=lc.GGML_TYPE_F32, type_v=lc.GGML_TYPE_F32) if f32_cache else {}
    llm = lc.Llama(str(gguf), n_ctx=max_context, n_threads=2, n_threads_batch=2, verbose=False, **cache)
    vocab = llm.n_vocab()

    def call(ids: list[int], start: int) -> int:
        if start == 0:
            llm.reset()
        llm.eval(ids)
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

    call.llm = llm
    return call


def greedy_tokens(call, prompt: list[int], n: int) -> list[int]:
    tokens = [call(prompt, 0)]
    for i in range(n - 1):
        tokens.append(call([tokens[-1]], len(prompt) + i))
    return tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3_5", "lfm2"], choices=["qwen3_5", "lfm2"])
    ap.add_argument("--variants", nargs="+", default=["fp32", "int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--far", type=int, default=2000)
    ap.add_argument("--long", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", type=Path, metavar="SRC", help="also run llama.cpp, converting with SRC's converter")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    import executorch_mlx  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        programs = {}
        for shape in args.shapes:
            folder = write_folder(tmp / shape, shape)
            for variant in args.variants:
                pte = export(folder, folder, variant, args.far + args.decode + 1, whole_cache=False)
                programs[f"{shape} {variant}"] = greedy_caller(pte)
                if args.llama_cpp:
                    gguf = llama_cpp_gguf(folder, variant, args.llama_cpp)
                    programs[f"{shape} {variant} llama.cpp"] = llama_cpp_caller(gguf, args.far + args.decode + 1)
        prompt = lambda n, a: [(a * i + 7) % VOCAB for i in range(n)]  # noqa: E731
        short, long, far = prompt(64, 31), prompt(args.long, 17), prompt(args.far, 13)
        if args.llama_cpp and "fp32" in args.variants:
            for shape in args.shapes:  # the same weights: the same greedy tokens at fp32
                ours, theirs = (greedy_tokens(programs[f"{shape} fp32{who}"], short, 8) for who in ("", " llama.cpp"))
                print(f"{shape} fp32 greedy, 8 tokens: ours {ours}, llama.cpp {theirs}: "
                      f"{'equal' if ours == theirs else 'DIFFER'}", flush=True)
        keys = ("prefill 64", f"prefill {args.long}", "decode at 64", f"decode at {args.far}")
        results = {label: {k: [] for k in keys} for label in programs}

        def decode(call, token: int, start: int) -> float:
            steps = []
            for i in range(args.decode):
                t0 = time.perf_counter()
                token = call([token], start + i)
                steps.append(time.perf_counter() - t0)
            return 1 / statistics.median(steps)

        for call in programs.values():  # warm-up
            call(short[:4], 0)
        for rep in range(args.reps):
            for label, call in programs.items():
                r = results[label]
                t0 = time.perf_counter()
                token = call(short, 0)
                r["prefill 64"].append(len(short) / (time.perf_counter() - t0))
                r["decode at 64"].append(decode(call, token, len(short)))
                t0 = time.perf_counter()
                call(long, 0)
                r[f"prefill {args.long}"].append(len(long) / (time.perf_counter() - t0))
                r[f"decode at {args.far}"].append(decode(call, call(far, 0), len(far)))
                time.sleep(SETTLE_S)  # (llama.cpp's threads spin after their work: as bench_llm, let them settle)
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)

    print(f"\nmedians of {args.reps}, tok/s; musts (ours): decode at {args.far} >= 0.9x decode at 64, prefill of "
          f"{args.long} >= 0.8x prefill of 64 per token\n")
    print("| program | " + " | ".join(keys) + f" | decode {args.far} / 64 | prefill {args.long} / 64 |")
    print("|---|" + "---|" * (len(keys) + 2))
    failed, medians = [], {}
    for label, r in results.items():
        m = medians[label] = {k: statistics.median(v) for k, v in r.items()}
        far_ratio = m[f"decode at {args.far}"] / m["decode at 64"]
        long_ratio = m[f"prefill {args.long}"] / m["prefill 64"]
        ours = not label.endswith("llama.cpp")  # (the musts are ours; llama.cpp's ratios are shown as they are)
        if ours and far_ratio < 0.9:
            failed.append(f"{label} decode")
        if ours and long_ratio < 0.8:
            failed.append(f"{label} prefill")
        print(f"| {label} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + f" | {far_ratio:.2f} | {long_ratio:.2f} |")
    for label, m in medians.items():
        theirs = medians.get(f"{label} llama.cpp")
        if theirs:
            print(f"{label} ours / llama.cpp: " + ", ".join(f"{k} {m[k] / theirs[k]:.2f}x" for k in keys))
    print(f"\nmusts: {'all PASS' if not failed else 'FAIL: ' + ', '.join(failed)}")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
