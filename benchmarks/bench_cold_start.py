"""Cold start: a fresh process's time to its first token, ours against llama.cpp.

    .venv/bin/python benchmarks/bench_cold_start.py                 # int4, 5 rounds
    .venv/bin/python benchmarks/bench_cold_start.py --variant int8 --rounds 3

The "large" Llama config of bench_llm.py (~104M parameters, random weights),
int4 (group 64; llama.cpp: Q4_0) or int8 (Q8_0), max context 256. Each round
starts, one after the other, a fresh Python process per engine that imports
its runtime, loads the program, prefills a 64-token prompt and takes the
first token (greedy). The time is the parent's, from starting the process to
reading its token: the interpreter's start-up counts, its exit does not. The
child reports its own phases too (import, load, prefill and first token).

  ours        LLMRunner(pte).generate(ids, max_new_tokens=1)
  llama.cpp   llama_cpp.Llama(gguf, 2 threads).eval(ids), argmax of its logits

#37's goal: ours <= 1.0 s. Needs the bench extra (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_llm import GROUP_SIZE, load_average, machine, write_folder

PROMPT = [(31 * i + 7) % 32000 for i in range(64)]
MAX_CONTEXT = 256

OURS = """
import sys, time
t0 = time.perf_counter()
from executorch_mlx.llm.run.runner import LLMRunner
t1 = time.perf_counter()
runner = LLMRunner(sys.argv[1])
t2 = time.perf_counter()
token = runner.generate(PROMPT, max_new_tokens=1).token_ids[0]
t3 = time.perf_counter()
print(json.dumps({"token": token, "phases": [t1 - t0, t2 - t1, t3 - t2], "torch": "torch" in sys.modules}),
      flush=True)
"""

LLAMA_CPP = """
import sys, time
t0 = time.perf_counter()
import llama_cpp
import numpy as np
t1 = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=MAX_CONTEXT, n_threads=2, n_threads_batch=2, verbose=False)
t2 = time.perf_counter()
llm.eval(PROMPT)
token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
t3 = time.perf_counter()
print(json.dumps({"token": token, "phases": [t1 - t0, t2 - t1, t3 - t2], "torch": "torch" in sys.modules}),
      flush=True)
"""


def first_token(code: str, path: Path) -> dict:
    """Runs `code` in a fresh interpreter; its report, with the seconds from
    the start of the process to the token."""
    prelude = f"import json\nPROMPT = {PROMPT}\nMAX_CONTEXT = {MAX_CONTEXT}\n"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", prelude + code, str(path)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    if proc.wait() != 0 or not line:
        raise RuntimeError(f"the cold-start process for {path.name} failed ({proc.returncode})")
    return {**json.loads(line), "total": elapsed}


def programs(variant: str, tmp: Path) -> dict[str, Path]:
    from gguf_folder import write_gguf

    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    folder = write_folder(tmp / "large", small=False, layers=None, hidden=None)
    pte = export_llm(folder, tmp / f"ours-{variant}.pte",
                     ExportOptions(max_context=MAX_CONTEXT, quantize=variant, group_size=GROUP_SIZE,
                                   quantize_embedding=True), progress=None)
    quant = {"int8": "Q8_0", "int4": "Q4_0"}[variant]
    return {"ours": pte, "llama.cpp": write_gguf(folder, tmp / f"llama-{quant}.gguf", quant)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="int4", choices=["int4", "int8"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    print("command: " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    codes = {"ours": OURS, "llama.cpp": LLAMA_CPP}
    with tempfile.TemporaryDirectory() as tmp:
        paths = programs(args.variant, Path(tmp))
        for name, path in paths.items():
            print(f"{name}: {path.name}, {path.stat().st_size / 2**20:.1f} MiB", flush=True)
        # each file read once first: every round then meets it in the page cache, as a second run does
        for name in paths:
            first_token(codes[name], paths[name])
        runs = {name: [] for name in paths}
        for r in range(args.rounds):
            for name in list(paths)[r % 2:] + list(paths)[:r % 2]:  # alternating who goes first
                runs[name].append(first_token(codes[name], paths[name]))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]['total']:.3f} s" for n, v in runs.items()),
                  flush=True)
    print(f"\n{args.variant}, 64-token prompt, median of {args.rounds} fresh processes (seconds)\n")
    print("| engine | to first token | import | load | prefill + first token | torch imported |")
    print("|---|---|---|---|---|---|")
    median = {}
    for name, rs in runs.items():
        median[name] = statistics.median(r["total"] for r in rs)
        phases = [statistics.median(r["phases"][i] for r in rs) for i in range(3)]
        print(f"| {name} | {median[name]:.3f} | " + " | ".join(f"{p:.3f}" for p in phases) +
              f" | {'yes' if any(r['torch'] for r in rs) else 'no'} |")
    tokens = {name: rs[0]["token"] for name, rs in runs.items()}
    print(f"\nfirst tokens: {tokens} (random weights; Q4_0/Q8_0 are other quantizations than ours)")
    print(f"ours / llama.cpp time to first token: {median['ours'] / median['llama.cpp']:.2f}x; "
          f"ours <= 1.0 s: {'yes' if median['ours'] <= 1.0 else 'NO'}")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
