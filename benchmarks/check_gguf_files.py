"""GGUF files written by llama.cpp's own converter and quantizer, exported
as they are: greedy ids of our program against llama.cpp's on the same file.

    PYTHONPATH=... .venv/bin/python benchmarks/check_gguf_files.py LLAMA_CPP_SRC [--tokens 32]

For a random-weight Llama and Qwen3 folder (hidden 256, 4 layers, the
folder's trained byte-level tokenizer), llama.cpp's converter
(llama_cpp_convert.py: `convert_hf_to_gguf.py` of LLAMA_CPP_SRC) writes an
F32 file and llama.cpp's quantizer (llama-cpp-python, the bench extra)
makes Q8_0 and Q4_0 files of it, every tensor in that type (`pure`: by
default llama.cpp keeps the output layer at Q6_K, which export quantizes
again at 6 bits and says so). Each file is exported with `executorch-mlx
export FILE.gguf` (no --quantize) and run with the tokenizer read from the
file itself; printed per file: the prompt's ids under both tokenizers, the
greedy tokens that agree with llama.cpp's (its KV cache in float16, its
default, and in float32, as ours), and where they first differ, llama.cpp's
logit gap between its token and ours (how near a tie that step is);
llama.cpp's own greedy tokens with a float16 cache against a float32 one
(how far a float-noise change moves llama.cpp itself); and the greedy
tokens that agree with transformers run on the file's values (each tensor
dequantized by the gguf package, activations in float: quantized files
part from it where llama.cpp's and our 8-bit activations round).

Random weights give nearly flat logits, where the order of float additions
alone picks between near-equal tokens. Free-running greedy ids compound one
such difference into all later ones, so for random weights the verdict
feeds llama.cpp's own greedy tokens (float32 cache) to both and compares
each step's choice: a step where they differ must be a near tie,
llama.cpp's gap between its token and ours below the largest logit
difference of the two at that step.

Each folder is also trained (`--train-steps`, AdamW on the tokenizer's own
text, ~10 s) until it recites that text, as a real model is confident about
most of its next tokens; the prompt is the text's first sentence. For those
files the verdict is the issue's own: our free-running greedy ids equal
llama.cpp's (float32 cache), every token. Exit status 0 when both verdicts
hold for every file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import llama_cpp  # noqa: F401  (before torch: its OpenMP build loaded after torch crashes the process)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_state_layers import greedy_tokens, llama_cpp_caller  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
TRAINED_PROMPT = "The quick brown fox jumps over the lazy dog."
QUANT = {"F32": None, "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def convert(src: Path, folder: Path, qtype: str) -> Path:
    import subprocess

    import llama_cpp as lc

    f32 = folder.with_suffix(".f32.gguf")
    if not f32.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("llama_cpp_convert.py")), str(src), str(folder),
                        "--outfile", str(f32), "--outtype", "f32"], check=True, capture_output=True)
    if QUANT[qtype] is None:
        return f32
    out = folder.with_suffix(f".{qtype}.gguf")
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, QUANT[qtype])
    params.pure = True
    if lc.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f32} to {qtype}")
    return out


def file_values_greedy(folder: Path, gguf_path: Path, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the folder's model with every weight replaced by the file's dequantized value."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.export.gguf_files import _halves, _hf_name

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    state = model.state_dict()
    config = model.config
    interleaved = config.model_type == "llama"
    for t in gguf.GGUFReader(gguf_path).tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") and interleaved else ""
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(kind)
        state[_hf_name(t.name)].copy_(torch.from_numpy(np.array(_halves(values, heads) if heads else values)))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a llama.cpp source tree (its converter)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=60)
    args = ap.parse_args()
    import numpy as np

    from executorch_mlx.llm import ExportOptions, LLMRunner, export_llm
    from executorch_mlx.llm.model_folders import write_model_folder

    print("command: " + " ".join(sys.argv))
    all_equal = True
    with tempfile.TemporaryDirectory() as tmp:
        for family, trained in [(f, t) for f in ("llama", "qwen3") for t in (False, True)]:
            name = f"{family}-trained" if trained else family
            folder = write_model_folder(Path(tmp) / name, family, layers=4, hidden=256, heads=8, kv_heads=4,
                                        intermediate=512)
            if trained:
                train(folder, args.train_steps)
            for qtype in QUANT:
                gguf = convert(args.src, folder, qtype)
                pte = export_llm(gguf, Path(tmp) / f"{name}-{qtype}.pte", ExportOptions(max_context=256), progress=None)
                runner = LLMRunner(pte, gguf)
                prompt = TRAINED_PROMPT if trained else PROMPT
                ids = runner.tokenizer.encode(prompt).ids
                ours = runner.generate(ids, max_new_tokens=args.tokens, temperature=0).token_ids
                line = f"{family} {'trained' if trained else 'random'} {qtype}:"
                greedy = {}
                for f32_cache in (False, True):
                    call = llama_cpp_caller(gguf, 256, f32_cache)
                    if not f32_cache:  # (the same vocabulary either way)
                        theirs_ids = call.llm.tokenize(prompt.encode(), add_bos=False, special=False)
                        line += f" prompt ids {'equal' if ids == theirs_ids else 'DIFFER'} ({len(ids)});"
                    theirs = greedy[f32_cache] = greedy_tokens(call, ids, args.tokens)
                    same = agreeing(ours, theirs)
                    cache = "float32" if f32_cache else "float16"
                    line += f" llama.cpp with a {cache} cache: {same}/{len(ours)} equal"
                    if same < len(ours):
                        logits = last_logits(call, ids + theirs[:same])
                        line += f" (step {same}: its logit gap {logits[theirs[same]] - logits[ours[same]]:.4f})"
                    line += ";"
                    if f32_cache and trained:  # the verdict: every greedy token equal
                        all_equal &= ours == theirs and ids == theirs_ids
                        line += f" its smallest top-2 logit gap on the way {smallest_gap(call, ids, theirs):.2f}"
                    elif f32_cache:  # the verdict: llama.cpp's tokens, fed to both, step by step
                        forced, ties = teacher_forced(call, Path(tmp) / name, gguf, ids, theirs)
                        line += f" fed llama.cpp's tokens: {forced}"
                        all_equal &= ties
                    del call
                line += (f"; llama.cpp itself, float16 against float32 cache: {agreeing(*greedy.values())}/"
                         f"{len(greedy[True])}")
                exact = file_values_greedy(folder, gguf, ids, args.tokens)
                line += f"; transformers on the file's values (float x): {agreeing(ours, exact)}/{len(ours)} equal"
                print(line, flush=True)
    return 0 if all_equal else 1


def train(folder: Path, steps: int) -> None:
    """Trains the folder's model on its tokenizer's text in place (the whole
    text as one sequence, AdamW), until its greedy choices are confident."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.model_folders import TEXT

    torch.manual_seed(0)
    text = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids])
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(text, labels=text).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)


def agreeing(a: list[int], b: list[int]) -> int:
    """How many greedy tokens agree before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def smallest_gap(call, prompt: list[int], tokens: list[int]) -> float:
    """llama.cpp's smallest gap between its best and second-best logit over
    the steps of its greedy `tokens` (how confident the model is)."""
    import numpy as np

    return min(float(np.diff(np.sort(last_logits(call, prompt + tokens[:i]))[-2:])[0]) for i in range(len(tokens)))


def last_logits(call, ids: list[int]):
    import numpy as np

    call(ids, 0)
    return np.ctypeslib.as_array(call.llm._ctx.get_logits(), shape=(call.llm.n_vocab(),)).copy()


def teacher_forced(call, stem: Path, gguf: Path, prompt: list[int], theirs: list[int]) -> tuple[str, bool]:
    """Each step's argmax of ours and llama.cpp's on the same tokens (llama.cpp's
    greedy ones, so no difference compounds), each step prefilled whole. A
    step where they differ is a near tie when llama.cpp's gap between its
    token and ours is below the largest logit difference of ours and its at
    that step (a rounding of x gone the other way moves logits by that much);
    (the summary, every differing step a near tie)."""
    import numpy as np
    import torch

    from executorch_mlx.llm import ExportOptions, LLMRunner, export_llm

    pte = export_llm(gguf, stem.with_name(stem.name + "-logits.pte"), ExportOptions(max_context=256, sampling=False),
                     progress=None)
    method = LLMRunner(pte, gguf).method
    steps, ties, noise = [], True, []
    for i, token in enumerate(theirs):
        seq = prompt + theirs[:i]
        ours = method.execute([np.array([seq]), np.arange(len(seq))])[0].reshape(-1).astype(np.float32)
        logits = last_logits(call, seq)
        diff = float(np.abs(ours - logits).max())
        noise.append(diff)
        if int(ours.argmax()) != token:
            gap = float(logits[token] - logits[int(ours.argmax())])
            ties &= gap < diff
            steps.append(f"step {i} gap {gap:.3f} < {diff:.3f}" if gap < diff else f"step {i} gap {gap:.3f} NOT A TIE")
    summary = f"{len(theirs) - len(steps)}/{len(theirs)} equal, logits within {max(noise):.2g} (median " \
              f"{float(np.median(noise)):.2g})" + (f", differing at {', '.join(steps)}" if steps else "")
    return summary, ties


if __name__ == "__main__":
    sys.exit(main())
