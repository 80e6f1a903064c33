"""Prefill and decode speed of this checkout against an earlier commit, in one run.

    .venv/bin/python benchmarks/bench_versions.py 0128215              # fp32 int8 int4, 3 rounds
    .venv/bin/python benchmarks/bench_versions.py HEAD~5 --variants int4 --rounds 5

The earlier commit is checked out in a temporary git worktree and set up there
with its own virtual environment (`scripts/dev setup`, ~2 minutes). Both
versions export bench_llm.py's ~104M Llama folder (the same weights) at max
context 256 (int8/int4: group size 64, embedding quantized too); then each
round runs, in a fresh process per version, alternately: for every format, a
64-token prompt and 32 greedy decode steps through that version's
`LLMRunner.generate`. Printed: the medians of the rounds, the ratios now /
then, and whether both versions' greedy ids agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_llm import load_average, machine, write_folder  # noqa: E402

PROMPT = [(31 * i + 7) % 32000 for i in range(64)]


def child_export(out: Path, folder: Path, variants: list[str]) -> None:
    from executorch_mlx.llm.export import hf_export

    for v in variants:
        options = dict(max_context=256) if v == "fp32" else dict(max_context=256, quantize=v, group_size=64,
                                                                  quantize_embedding=True)
        if hasattr(hf_export, "ExportOptions"):
            hf_export.export_llm(folder, out / f"{v}.pte", hf_export.ExportOptions(**options), progress=None)
        else:  # (a version from before ExportOptions)
            hf_export.export_llm(folder, out / f"{v}.pte", progress=None, **options)


def child_time(out: Path, variants: list[str]) -> dict:
    from executorch_mlx.llm.run.runner import LLMRunner

    torch.set_num_threads(1)
    result = {}
    for v in variants:
        runner = LLMRunner(out / f"{v}.pte")
        runner.generate([5, 6, 8], max_new_tokens=2)  # warm-up, no prefix in common with the prompt
        r = runner.generate(PROMPT, max_new_tokens=33)
        result[v] = [r.prefill_tokens_per_s, r.decode_tokens_per_s, r.token_ids]
    return result


def run(python: str, *args) -> str:
    done = subprocess.run([python, __file__, *map(str, args)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir())  # not the repository: each python imports its own version
    if done.returncode:
        raise RuntimeError(f"{python} {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", nargs="?", help="the earlier commit")
    ap.add_argument("--variants", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("JOB", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job, out = args.child[0], Path(args.child[1])
        if job == "export":
            child_export(out, args.folder, args.variants)
        else:
            print(json.dumps(child_time(out, args.variants)))
        return 0
    if not args.base:
        ap.error("the earlier commit is required")
    repo = HERE.parent
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                      text=True, check=True).stdout.strip():
        head += "+changes"  # (this checkout's uncommitted changes: another version than its commit)
    if base == head:
        ap.error(f"{args.base} is this checkout, unchanged: name an earlier commit")
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-versions-") as tmp:
        tmp = Path(tmp)
        tree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), base], cwd=repo, check=True)
        try:
            venv = tmp / "venv"
            print(f"setting up {base} in {tree} ...", flush=True)
            subprocess.run(["scripts/dev", "setup"], cwd=tree, check=True, capture_output=True,
                           env={**os.environ, "EMLX_VENV": str(venv)})
            folder = write_folder(tmp / "large", False, None, None)
            pythons = {base: str(venv / "bin" / "python"), head: str(repo / ".venv" / "bin" / "python")}
            for name, python in pythons.items():
                (tmp / name).mkdir()
                run(python, "--child", "export", tmp / name, "--folder", folder, "--variants", *args.variants)
                print(f"exported {name}", flush=True)
            rounds = {name: [] for name in pythons}
            for i in range(args.rounds):
                for name, python in pythons.items():
                    rounds[name].append(json.loads(run(python, "--child", "time", tmp / name, "--variants",
                                                       *args.variants)))
                print(f"round {i + 1}/{args.rounds} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, check=False)
    print(f"\nmedians of {args.rounds} rounds; prompt 64 tokens, 32 decode steps, greedy\n")
    print(f"| format | prefill tok/s {base} | prefill tok/s {head} | ratio | decode tok/s {base} | "
          f"decode tok/s {head} | ratio | same greedy ids |")
    print("|---|---|---|---|---|---|---|---|")
    for v in args.variants:
        med = {name: [statistics.median(r[v][k] for r in rounds[name]) for k in (0, 1)] for name in rounds}
        same = all(r[v][2] == rounds[head][0][v][2] for name in rounds for r in rounds[name])
        print(f"| {v} | {med[base][0]:.1f} | {med[head][0]:.1f} | {med[head][0] / med[base][0]:.2f}x | "
              f"{med[base][1]:.1f} | {med[head][1]:.1f} | {med[head][1] / med[base][1]:.2f}x | {same} |")
    print(f"\nload average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
