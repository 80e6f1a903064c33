"""Folders written by mlx-lm's own converter, exported as they are: the
packed weights in the .pte are the folder's bytes, and greedy generation
equals mlx-lm's on the same folder.

    .venv/bin/python benchmarks/check_mlx_lm_folders.py [--hidden 256 --layers 4 --tokens 32]

Writes a random-weight Llama folder (float32, tied embeddings), converts it
with `mlx_lm.convert(quantize=True)` at 4 bits and at 8 bits (group size
64, float32 scales), exports each with `executorch-mlx export` (no
--quantize) and compares: the share of the folder's packed weights found
byte for byte in the .pte, and the greedy token ids of ours and of mlx-lm's
generate_step for the same prompt. Needs mlx-lm (the bench extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def mlx_lm_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(token) for token, _ in steps]


def mlx_lm_gap(folder: Path, ids: list[int], theirs: int, ours: int) -> float:
    """mlx-lm's logit of its own choice minus that of ours, after `ids`
    (how near a tie the step where the two differ is)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return float(logits[theirs] - logits[ours])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from mlx_lm.convert import convert
    from safetensors.numpy import load_file

    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.model_folders import write_model_folder
    from executorch_mlx.llm.run.runner import LLMRunner

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        src = write_model_folder(Path(tmp) / "hf", "llama", layers=args.layers, hidden=args.hidden,
                                 heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                                 intermediate=2 * args.hidden)
        print(f"| bits | packed tensors in the .pte | greedy ids equal mlx-lm's | first {args.tokens} ids (ours) |")
        print("|---|---|---|---|")
        for bits in (4, 8):
            folder = Path(tmp) / f"mlx{bits}"
            convert(str(src), str(folder), quantize=True, q_group_size=64, q_bits=bits, dtype="float32")
            pte = export_llm(folder, Path(tmp) / f"mlx{bits}.pte", ExportOptions(max_context=256), progress=None)
            data = pte.read_bytes()
            packed = [t for f in folder.glob("*.safetensors") for t in load_file(str(f)).values()
                      if t.dtype.name == "uint32"]
            found = sum(t.tobytes() in data for t in packed)
            runner = LLMRunner(pte, src)
            ids = runner.tokenizer.encode(PROMPT).ids
            ours = runner.generate(PROMPT, max_new_tokens=args.tokens).token_ids
            theirs = mlx_lm_greedy(folder, ids, args.tokens)
            same = ours == theirs
            failed |= not same or found != len(packed)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            gap = "" if same else f", mlx-lm's logits {mlx_lm_gap(folder, ids + ours[:first], theirs[first], ours[first]):.2g} apart"
            print(f"| {bits} | {found} of {len(packed)} | {'yes' if same else f'no (from token {first}{gap})'} "
                  f"| {ours} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
