"""Decode speed with a JSON schema's mask against unconstrained decoding, and
the host's mask time per token, on the ~104M Llama config of bench_llm.py.

    .venv/bin/python benchmarks/bench_structured.py [--reps 5] [--tokens 64]

The folder has random weights and a 32,000-token byte-level BPE tokenizer
trained here on the Python standard library's sources (a real-sized
vocabulary for llguidance's mask; nothing is downloaded). Both runs use the
same program, prompt, temperature (1.0) and seed, interleaved per
repetition; medians. The schema asks for one long string, so that the
constrained run decodes as many tokens as the unconstrained one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_llm import load_average, machine, write_folder  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
          "required": ["text"], "additionalProperties": False}


def train_tokenizer(folder: Path, vocab: int = 32000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):  # a few test files are not UTF-8 on purpose
            pass
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    print(f"tokenizer: {tok.get_vocab_size()} tokens, trained on {len(texts)} stdlib files", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    args = ap.parse_args()
    print(f"machine: {machine()}; load average at start {load_average()}", flush=True)

    from executorch_mlx.llm.run import grammar
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.run.runner import LLMRunner

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "model", small=False, layers=None, hidden=None)
        train_tokenizer(folder)
        pte = export_llm(folder, Path(tmp) / "model.pte", ExportOptions(max_context=256), progress=None)
        runner = LLMRunner(pte, folder)

        mask_seconds: list[float] = []
        real_mask = grammar.TokenConstraint.mask

        def timed_mask(self):
            t = time.perf_counter()
            out = real_mask(self)
            mask_seconds.append(time.perf_counter() - t)
            return out

        grammar.TokenConstraint.mask = timed_mask
        rates = {"unconstrained": [], "JSON schema": []}
        steps = {"unconstrained": [], "JSON schema": []}
        prompt = "def main():"
        runner.generate(prompt, max_new_tokens=8, temperature=1.0, seed=0)  # warm-up
        for rep in range(args.reps):
            for name, extra in (("unconstrained", {}), ("JSON schema", {"json_schema": SCHEMA})):
                runner.reset()
                result = runner.generate(prompt, max_new_tokens=args.tokens, temperature=1.0, seed=rep, **extra)
                rates[name].append(result.decode_tokens_per_s)
                steps[name].append(len(result.token_ids))
        base = statistics.median(rates["unconstrained"])
        print(f"\n{args.reps} repetitions, {args.tokens} tokens each, temperature 1.0; medians\n")
        print("| decoding | tokens decoded | decode tokens/s | vs unconstrained |")
        print("|---|---|---|---|")
        for name, values in rates.items():
            rate = statistics.median(values)
            print(f"| {name} | {statistics.median(steps[name]):.0f} | {rate:.1f} | {rate / base:.3f} |")
        per_token = sorted(mask_seconds)
        print(f"\nhost mask time per token ({runner.vocab_size} tokens): median "
              f"{1e3 * statistics.median(per_token):.3f} ms, p90 {1e3 * per_token[int(0.9 * len(per_token))]:.3f} ms "
              f"({len(per_token)} masks)")
    print(f"load average at end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
