"""Speculative decoding on the ~104M Llama config of bench_llm.py: what a
verify call costs, and what prompt lookup and a draft model give, against
plain decoding in the same run.

    .venv/bin/python benchmarks/bench_speculative.py                 # fp32
    .venv/bin/python benchmarks/bench_speculative.py --variant int4

Measured, medians of --reps repetitions with the contenders interleaved:

  plain            the target program (verifies up to 8 drafts) decoding one
                   token a call; `plain, no verifier` is the same model
                   exported with --max-draft-tokens 0 (what verification costs
                   a plain step)
  verify K         one call scoring K = 1, 2, 4, 8 drafts, against one decode call
  prompt lookup    a prompt whose continuation repeats it: the prompt is the
                   target's own greedy output after a seed text, so it has
                   fallen into the loop a random-weight model falls into, and
                   the continuation repeats it
  draft model      `self-2`: the target's first 2 layers (same embeddings,
                   tokenizer and head: a layer-skip drafter); `random-2`: a
                   2-layer model of other random weights (acceptance near 0),
                   with adaptive drafting and with a fixed draft length of 4

Every drafted generation must give plain decoding's tokens; the musts of
issue 20 are checked at the end. Needs nothing beyond the test dependencies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import GROUP_SIZE, SETTLE_S, load_average, machine, write_folder  # noqa: E402

K_MAX = 8
TEMPERATURE = 0.8


def export(folder: Path, out: Path, variant: str, max_context: int, drafts: int):
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.run.runner import LLMRunner

    options = dict(quantize=variant, group_size=GROUP_SIZE, quantize_embedding=True) if variant != "fp32" else {}
    t0 = time.perf_counter()
    pte = export_llm(folder, out, ExportOptions(max_context=max_context, max_draft_tokens=drafts, **options),
                     progress=None)
    print(f"exported {out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return LLMRunner(pte)


def draft_folder(target: Path, path: Path, layers: int, seed: int | None = None) -> Path:
    """The target's first `layers` layers with its embeddings, norm and head;
    with a `seed`, a model of that shape with other random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if seed is None:
        model = AutoModelForCausalLM.from_pretrained(target)
        model.model.layers = model.model.layers[:layers]
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target, num_hidden_layers=layers))
    model.config.num_hidden_layers = layers
    model.save_pretrained(path)
    return path


def call_seconds(runner, fed: list[int], position: int, reps: int) -> float:
    """The median seconds of one call feeding `fed` (the last len(fed) - 1 drafts)."""
    import numpy as np

    from executorch_mlx.llm.run.decode_parts import history_rows

    given = {"temperature": np.array(TEMPERATURE, dtype=np.float32), "seed": np.array(1), "position": np.array(0),
             "history": history_rows([], fed[1:], 0)}
    sampler = runner.sampler_values(runner.input_names[2:], given)
    ids, positions = np.array([fed]), np.arange(position, position + len(fed))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute([ids, positions] + sampler)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--steps", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from executorch_mlx.third_party_warnings import hide_known_warnings

    hide_known_warnings()
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = write_folder(tmp / "target", small=False, layers=None, hidden=None)
        target = export(folder, tmp / "target.pte", args.variant, args.max_context, K_MAX)
        no_verifier = export(folder, tmp / "target-k0.pte", args.variant, args.max_context, 0)
        self_2 = export(draft_folder(folder, tmp / "self-2", 2), tmp / "self-2.pte", args.variant,
                        args.max_context, 0)
        random_2 = export(draft_folder(folder, tmp / "random-2", 2, seed=1), tmp / "random-2.pte", args.variant,
                          args.max_context, 0)

        # A prompt that has fallen into the target's greedy loop: its own output.
        seed_text = [(31 * i + 7) % 32000 for i in range(16)]
        loop = target.generate(seed_text, max_new_tokens=192, temperature=0.0).token_ids
        repeating = seed_text + loop
        fresh = [(17 * i + 3) % 32000 for i in range(64)]  # no repetition to look up
        print(f"prompt lookup prompt: {len(repeating)} tokens; distinct ids in its last 64: "
              f"{len(set(repeating[-64:]))}", flush=True)

        runs = {  # name -> (runner, prompt, generate keywords)
            "plain (greedy)": (target, repeating, dict(temperature=0.0)),
            "plain, no verifier (greedy)": (no_verifier, repeating, dict(temperature=0.0)),
            "prompt lookup (greedy)": (target, repeating, dict(temperature=0.0, draft="prompt-lookup")),
            "plain (sampled)": (target, repeating, dict(temperature=TEMPERATURE, seed=5)),
            "prompt lookup (sampled)": (target, repeating, dict(temperature=TEMPERATURE, seed=5,
                                                               draft="prompt-lookup")),
            "plain, fresh prompt (greedy)": (target, fresh, dict(temperature=0.0)),
            "self-2 draft (greedy)": (target, fresh, dict(temperature=0.0, draft=self_2)),
            "random-2 draft (greedy)": (target, fresh, dict(temperature=0.0, draft=random_2)),
            "random-2 draft, fixed 4 (greedy)": (target, fresh, dict(temperature=0.0, draft=random_2,
                                                                     num_draft_tokens=4, adaptive_drafting=False)),
        }
        results = {name: [] for name in runs}
        names = list(runs)
        for rep in range(args.reps):
            for name in names[rep:] + names[:rep]:
                runner, prompt, kwargs = runs[name]
                # Every run prefills its prompt into an empty cache: a prompt met
                # again from the cache another run left is computed in other calls
                # (a decode step per token, not one prefill), whose logits differ
                # by rounding (up to ~1e-3 of their spread), which can tip a sampled token.
                runner.reset()
                time.sleep(SETTLE_S)
                results[name].append(runner.generate(prompt, max_new_tokens=args.steps, **kwargs))
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)

        position = len(fresh)
        target.generate(fresh, max_new_tokens=1)  # the cache holds the prompt
        verify = {}
        for rep in range(args.reps):
            for k in (0, 1, 2, 4, 8):
                verify.setdefault(k, []).append(call_seconds(target, fresh[:k + 1], position, 10))
        verify = {k: statistics.median(v) for k, v in verify.items()}

    print(f"\n{args.variant}, {args.steps} tokens per run, max context {args.max_context}, median of {args.reps}\n")
    print("| run | decode tok/s | vs plain | drafted | accepted | acceptance | tokens equal plain |")
    print("|---|---|---|---|---|---|---|")
    identical = True
    rates = {}
    for name, rs in results.items():
        rate = statistics.median(r.decode_tokens_per_s for r in rs)
        rates[name] = rate
        mode = name.rsplit("(", 1)[1]
        base_name = "plain, fresh prompt (greedy)" if runs[name][1] is fresh else f"plain ({mode}"
        base = results[base_name]
        same = all(r.token_ids == base[0].token_ids for r in rs)
        identical &= same
        drafted = rs[0].draft_tokens
        accepted = rs[0].accepted_tokens
        share = f"{accepted / drafted:.2f}" if drafted else "-"
        print(f"| {name} | {rate:.1f} | {rate / statistics.median(r.decode_tokens_per_s for r in base):.2f}x | "
              f"{drafted} | {accepted} | {share} | {'yes' if same else 'NO'} |")
    print("\n| drafts in the call | call ms | vs a decode call |")
    print("|---|---|---|")
    for k, seconds in verify.items():
        print(f"| {k} | {seconds * 1e3:.2f} | {seconds / verify[0]:.2f}x |")

    def acceptance(name):
        r = results[name][0]
        return r.accepted_tokens / r.draft_tokens if r.draft_tokens else 0.0

    lookup = acceptance("prompt lookup (greedy)")
    musts = [
        ("outputs identical everywhere", identical),
        (f"a verify call with 4 drafts costs <= 2x a decode call ({verify[4] / verify[0]:.2f}x)",
         verify[4] <= 2 * verify[0]),
        (f"prompt lookup at >= 70% acceptance ({lookup:.0%}) gives >= 1.8x plain "
         f"({rates['prompt lookup (greedy)'] / rates['plain (greedy)']:.2f}x)",
         lookup >= 0.7 and rates["prompt lookup (greedy)"] >= 1.8 * rates["plain (greedy)"]),
        (f"acceptance near 0 ({acceptance('random-2 draft (greedy)'):.0%}): adaptive drafting <= 10% slower than "
         f"plain ({rates['random-2 draft (greedy)'] / rates['plain, fresh prompt (greedy)']:.2f}x)",
         rates["random-2 draft (greedy)"] >= 0.9 * rates["plain, fresh prompt (greedy)"]),
    ]
    print()
    for text, ok in musts:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    print(f"\nload average at end: {load_average()}")
    return 0 if all(ok for _, ok in musts) else 1


if __name__ == "__main__":
    sys.exit(main())
