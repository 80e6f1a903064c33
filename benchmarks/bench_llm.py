"""Prefill and decode tokens per second of Llama models, ours against peers,
for float32, bfloat16, int8 and int4 weights.

    .venv/bin/python benchmarks/bench_llm.py                    # both configs, every variant
    .venv/bin/python benchmarks/bench_llm.py --configs small --variants fp32 int4

Configs: "large" (~104M parameters: 8 layers, hidden 1024, vocab 32000) and
"small" (2 layers, hidden 256, vocab 32000: per-step overhead dominates).
Variants: fp32, bf16 (weights and compute), int8 and int4 (weight-only,
group size 64, embedding included, float32 compute).

Contenders, all on the same random-weight folder and prompt, their
repetitions interleaved (every variant of a config in each repetition) so
that machine noise hits all alike. Each engine and format runs in a process
of its own (loaded once, driven in turn by this one), as a user runs one:
in one shared process both ours and llama.cpp decoded slower than alone,
and not by the same factor (docs/benchmarks.md). Our .pte and llama.cpp's
GGUF are written by a process of their own before that one starts, as a
user exports once and runs many times: a process that had exported the
model decoded 4-12% slower than one that only loaded it (docs/benchmarks.md).

  ours (sampled)   executorch-mlx .pte, sampler on the device (T=0.8, seeded)
  ours (greedy)    the same program with T=0
  mlx-lm           the folder run natively on MLX (make_sampler: T=0.8 / greedy);
                   bf16: the model cast with set_dtype; int8/int4: quantized by
                   mlx-lm's own converter (mlx_lm.utils.quantize_model), same
                   bits and group size
  llama.cpp        the folder written as GGUF (gguf_folder.py: F32 / Q8_0 /
                   Q4_0 for fp32 / int8 / int4; no bf16) run by llama-cpp-python
                   with 2 threads; greedy: argmax of its logits, sampled: its own
                   sampler at T=0.8
  xnnpack          fp32 only: the same export lowered to ExecuTorch's XNNPACK
                   backend, logits to the host, torch sampling at 1 thread
  portable         fp32 only: the same export on ExecuTorch's portable kernels

A second table pairs ours with llama.cpp repetition by repetition (their
runs in one repetition are seconds apart; the machine's speed drifts by tens
of percent between repetitions): the median of the per-repetition ratios
and the repetitions ours won. `--skip mlx-lm` leaves out mlx-lm (10 tok/s in int4 on this CPU: its
runs put ~20 s between ours and llama.cpp's in each repetition).

Each contender's decode rate is also given as a share of the memory bound:
the machine's read bandwidth (measured at start, 2 threads) divided by the
bytes of weights it holds (file or parameter bytes), which a decode step
reads once.

Needs mlx-lm, llama-cpp-python and gguf (`pip install -e .[bench]`; llama-cpp-
python builds llama.cpp from source, ~10 minutes on 2 cores), benchmark-only
dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPERATURE = 0.8
SETTLE_S = 0.5


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {cpu}"


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def write_folder(path: Path, small: bool, layers: int | None, hidden: int | None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden = hidden or (256 if small else 1024)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers or (2 if small else 8), num_attention_heads=max(4, hidden // 64),
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=8192,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {cfg.num_hidden_layers} "
          f"layers, hidden {hidden}, vocab 32000, fp32 ({path})", flush=True)
    return path


# ------------------------------------------------------------ contenders --
# Each is (name, prefill(ids) -> first token, decode(token, pos) -> token).
VARIANTS = ("fp32", "bf16", "int8", "int4")
GROUP_SIZE = 64


def ours_program(folder: Path, out: Path, max_context: int, variant: str) -> Path:
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    t0 = time.perf_counter()
    options = dict(dtype="bf16") if variant == "bf16" else dict(
        quantize=variant, group_size=GROUP_SIZE, quantize_embedding=True) if variant.startswith("int") else {}
    pte = export_llm(folder, out / f"ours-{variant}.pte", ExportOptions(max_context=max_context, **options),
                     progress=None)
    print(f"exported ours {variant} in {time.perf_counter() - t0:.1f} s: {pte.stat().st_size / 2**20:.1f} MiB",
          flush=True)
    return pte


def program_call(runner, temperature: float):
    """call(ids, start) -> the token our program emits for `ids` at positions
    start, start + 1, ...: every sampler input the program takes at
    `temperature` (seed 42), what is not given off."""
    import numpy as np

    names = runner.input_names[2:]  # after input_ids and cache_position: the sampler's
    given = {"temperature": np.array(temperature, dtype=np.float32), "seed": np.array(42), "position": np.array(0)}
    sampler = runner.sampler_values(names, given)
    at = names.index("position")

    def call(ids: list[int], start: int) -> int:
        sampler[at] = np.array(start)
        inputs = [np.array([ids]), np.arange(start, start + len(ids))] + sampler
        return int(runner.method.execute(inputs)[0][0])

    return call


def ours(folder: Path, out: Path, max_context: int, variant: str):
    from executorch_mlx.llm.run.runner import LLMRunner

    pte = out / f"ours-{variant}.pte"  # (prepare: ours_program)
    runner = LLMRunner(pte)

    def make(temperature: float):
        call = program_call(runner, temperature)
        call.weight_bytes = pte.stat().st_size
        return call

    return [(f"{variant} ours (sampled)", make(TEMPERATURE)), (f"{variant} ours (greedy)", make(0.0))]


def mlx_lm_native(folder: Path, variant: str):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(folder)
    if variant == "bf16":
        model.set_dtype(mx.bfloat16)
    elif variant.startswith("int"):
        model, _ = quantize_model(model, config, GROUP_SIZE, int(variant[3:]))
    mx.eval(model.parameters())
    state = {}

    def make(temperature: float):
        sampler = make_sampler(temp=temperature)

        def call(ids: list[int], start: int) -> int:
            if start == 0:
                state["cache"] = make_prompt_cache(model)
            logits = model(mx.array([ids]), cache=state["cache"])[:, -1, :]
            token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            return int(token.item())

        call.weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        return call

    return [(f"{variant} mlx-lm (sampled)", make(TEMPERATURE)), (f"{variant} mlx-lm (greedy)", make(0.0))]


def executorch_baseline(folder: Path, name: str, partitioner, max_context: int):
    """The same HF export as ours (logits of the last position), lowered to
    another ExecuTorch backend; sampling on the host."""
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.export.hf_export import CachedLM

    t0 = time.perf_counter()
    lm = CachedLM(AutoModelForCausalLM.from_pretrained(folder).eval(), max_context)
    seq = torch.export.Dim("seq", min=1, max=max_context - 1)
    with torch.no_grad():
        ep = torch.export.export(lm, (torch.tensor([[0, 0]]), torch.arange(2)),
                                 dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}}, strict=True)
    pte = to_edge_transform_and_lower(ep, partitioner=partitioner).to_executorch().buffer
    print(f"exported {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    gen = torch.Generator().manual_seed(42)

    def call(ids: list[int], start: int) -> int:
        logits = method.execute([torch.tensor([ids]), torch.arange(start, start + len(ids))])[0][0, -1]
        probs = torch.softmax(logits / TEMPERATURE, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    call.program = program  # a Method does not keep its Program alive
    return [(f"fp32 {name} (sampled, host)", call)]


LLAMA_CPP_QUANT = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}


def llama_cpp_file(out: Path, variant: str) -> Path:
    return out / f"llama-{LLAMA_CPP_QUANT[variant]}.gguf"


def llama_cpp_program(folder: Path, out: Path, variant: str) -> Path:
    from gguf_folder import write_gguf

    return write_gguf(folder, llama_cpp_file(out, variant), LLAMA_CPP_QUANT[variant])


def llama_cpp(folder: Path, out: Path, max_context: int, variant: str):
    import llama_cpp as lc
    import numpy as np

    gguf = llama_cpp_file(out, variant)  # (prepare: llama_cpp_program)
    llm = lc.Llama(str(gguf), n_ctx=max_context, n_threads=2, n_threads_batch=2, seed=42, verbose=False)
    vocab = llm.n_vocab()

    def make(greedy: bool):
        def call(ids: list[int], start: int) -> int:
            if start == 0:
                llm.reset()
            llm.eval(ids)
            if greedy:
                return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())
            return int(llm.sample(temp=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0))

        call.weight_bytes = gguf.stat().st_size
        call.llm = llm
        return call

    return [(f"{variant} llama.cpp (sampled)", make(False)), (f"{variant} llama.cpp (greedy)", make(True))]


def bandwidth(threads: int = 2, mib: int = 512) -> float:
    """Read bandwidth in bytes/s: `threads` threads summing halves of a
    buffer larger than any cache (numpy releases the GIL), best of 5."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    buf = np.ones(mib * 2**20 // 8, dtype=np.float64)
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


# ----------------------------------------------------------------- timing --
def run_once(call, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds per token, tokens)."""
    t0 = time.perf_counter()
    token = call(prompt, 0)
    prefill = time.perf_counter() - t0
    tokens, t0 = [token], time.perf_counter()
    for i in range(steps):
        token = call([token], len(prompt) + i)
        tokens.append(token)
    return prefill, (time.perf_counter() - t0) / steps, tokens


def prepare(kind: str, variant: str, folder: str, out: str, max_context: str) -> int:
    """Writes what an engine's worker loads (ours: the .pte; llama.cpp: the
    GGUF), in a process of its own (Engine runs it before the worker)."""
    if kind == "ours":
        ours_program(Path(folder), Path(out), int(max_context), variant)
    elif kind == "llama.cpp":
        llama_cpp_program(Path(folder), Path(out), variant)
    return 0


def engine(kind: str, variant: str, folder: Path, out: Path, max_context: int):
    """The contenders of one engine and format, in this process."""
    if kind == "ours":
        return ours(folder, out, max_context, variant)
    if kind == "mlx-lm":
        return mlx_lm_native(folder, variant)
    if kind == "llama.cpp":
        return llama_cpp(folder, out, max_context, variant)
    if kind == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return executorch_baseline(folder, "xnnpack", [XnnpackPartitioner()], max_context)
    return executorch_baseline(folder, "portable", [], max_context)


def serve_engine(kind: str, variant: str, folder: str, out: str, max_context: str) -> int:
    """A worker: loads one engine's contenders, says their names and weight
    bytes, then runs `run_once` for each request line until stdin closes.
    Its protocol has stdout to itself; what else is printed goes to stderr."""
    if kind in ("xnnpack", "portable"):  # (the others do not run torch)
        import torch

        torch.set_num_threads(1)  # torch's spinning pool starves other threads on few cores
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    calls = dict(engine(kind, variant, Path(folder), Path(out), int(max_context)))
    print(json.dumps({name: getattr(call, "weight_bytes", None) for name, call in calls.items()}), file=proto,
          flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(run_once(calls[ask["name"]], ask["prompt"], ask["steps"])), file=proto, flush=True)
    return 0


class Engine:
    """One engine's worker process (serve_engine), started and loaded before
    the next starts, so that no two exports or loads overlap. `prepare`:
    write its file first (False: the caller has written it, see prepare)."""

    def __init__(self, kind: str, variant: str, folder: Path, out: Path, max_context: int, prepare: bool = True):
        self.kind, self.variant = kind, variant
        args = [kind, variant, str(folder), str(out), str(max_context)]
        if prepare and kind in ("ours", "llama.cpp"):
            subprocess.run([sys.executable, __file__, "--prepare", *args], check=True)
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.weight_bytes = self._answer("loading")

    def run(self, name: str, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
        print(json.dumps({"name": name, "prompt": prompt, "steps": steps}), file=self.proc.stdin, flush=True)
        return tuple(self._answer(f"running {name}"))

    def _answer(self, doing: str):
        line = self.proc.stdout.readline()
        if not line:  # e.g. -4 (SIGILL): a llama.cpp built for instructions this CPU lacks
            raise RuntimeError(f"the {self.kind} {self.variant} worker exited with {self.proc.wait()} {doing}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def bench_config(config: str, args, tmp: Path) -> None:
    folder = write_folder(tmp / config, config == "small", args.layers, args.hidden)
    out = tmp / f"{config}-pte"
    out.mkdir()
    kinds = [(kind, variant) for variant in args.variants for kind in ("ours", "mlx-lm", "llama.cpp")
             if kind not in args.skip and not (kind == "llama.cpp" and variant == "bf16")]
    kinds += [(kind, "fp32") for kind in ("xnnpack", "portable") if "fp32" in args.variants and kind not in args.skip]
    engines = []
    try:
        for kind, variant in kinds:  # (those started are closed if a later one fails)
            engines.append(Engine(kind, variant, folder, out, args.max_context))
        measure(config, args, engines)
    finally:
        for e in engines:
            e.close()


def measure(config: str, args, engines: list[Engine]) -> None:
    contenders = [(name, e) for e in engines for name in e.weight_bytes]
    prompt = [(31 * i + 7) % 32000 for i in range(args.prompt_len)]
    results = {name: [] for name, _ in contenders}
    for name, e in contenders:
        e.run(name, prompt[:4], 2)  # warm-up
    for rep in range(args.reps):
        # a rotating order: the first contender after another's run meets cold caches
        for name, e in contenders[rep:] + contenders[:rep]:
            # llama.cpp's and OpenBLAS's threads spin a while after their work:
            # let them settle before the next contender takes the cores
            time.sleep(SETTLE_S)
            results[name].append(e.run(name, prompt, args.decode))
        print(f"{config}: repetition {rep + 1}/{args.reps} done", flush=True)

    for variant in args.variants:
        ours_ids = results[f"{variant} ours (greedy)"][0][2]
        for peer in ("mlx-lm", "llama.cpp"):
            if f"{variant} {peer} (greedy)" in results:
                theirs = results[f"{variant} {peer} (greedy)"][0][2]
                agree = sum(a == b for a, b in zip(ours_ids, theirs))
                print(f"{variant} greedy ids, ours vs {peer}: {agree}/{args.decode + 1} equal (random weights: "
                      "near-ties and rounding may differ; llama.cpp's Q8_0/Q4_0 are other quantizations)")
    median = {name: (args.prompt_len / statistics.median(r[0] for r in runs),
                     1 / statistics.median(r[1] for r in runs)) for name, runs in results.items()}
    weight_bytes = {name: e.weight_bytes[name] for name, e in contenders}
    print(f"\n{config} config: prompt {args.prompt_len} tokens, {args.decode} decode steps, max context "
          f"{args.max_context}, median of {args.reps}; read bandwidth {args.bandwidth / 1e9:.1f} GB/s (2 threads)\n")
    print("| weights | contender | prefill tok/s | decode tok/s | prefill vs mlx-lm | decode vs mlx-lm | "
          "prefill vs llama.cpp | decode vs llama.cpp | decode share of the memory bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (prefill, decode) in median.items():
        variant, who = name.split(" ", 1)
        mode = "greedy" if "greedy" in name else "sampled"
        vs = [ratios((prefill, decode), median.get(f"{variant} {peer} ({mode})")) for peer in ("mlx-lm", "llama.cpp")]
        share = f"{decode * weight_bytes[name] / args.bandwidth:.2f}" if weight_bytes[name] else "-"
        print(f"| {variant} | {who} | {prefill:.1f} | {decode:.1f} | {vs[0][0]} | {vs[0][1]} | {vs[1][0]} | "
              f"{vs[1][1]} | {share} |")
    print_paired(results, args.variants)


def ratios(ours: tuple[float, float], theirs: tuple[float, float] | None) -> list[str]:
    return [f"{a / b:.2f}x" for a, b in zip(ours, theirs)] if theirs else ["-", "-"]


def print_paired(results: dict, variants: list[str]) -> None:
    """Ours against llama.cpp repetition by repetition (the two runs of a
    repetition are seconds apart, repetitions a minute or more): the median
    of the per-repetition ratios, and in how many repetitions ours was faster."""
    rows = []
    for variant in variants:
        for mode in ("greedy", "sampled"):
            ours, theirs = results.get(f"{variant} ours ({mode})"), results.get(f"{variant} llama.cpp ({mode})")
            if not (ours and theirs):
                continue
            cells = []
            for part in (0, 1):  # prefill, decode seconds: a ratio of theirs to ours is ours' speed-up
                paired = [b[part] / a[part] for a, b in zip(ours, theirs)]
                cells.append(f"{statistics.median(paired):.2f}x ({sum(r > 1 for r in paired)}/{len(paired)})")
            rows.append(f"| {variant} | {mode} | {cells[0]} | {cells[1]} |")
    if rows:
        print("\nOurs against llama.cpp, paired by repetition: median ratio (repetitions where ours was faster)\n")
        print("| weights | mode | prefill | decode |\n|---|---|---|---|")
        print("\n".join(rows))
    print(flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--engine"]:
        return serve_engine(*sys.argv[2:])
    if sys.argv[1:2] == ["--prepare"]:
        return prepare(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["large", "small"], choices=["large", "small"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--layers", type=int, help="override the config's layer count")
    ap.add_argument("--hidden", type=int, help="override the config's hidden size")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32, help="decode steps per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--skip", nargs="*", default=[], choices=["xnnpack", "portable", "llama.cpp", "mlx-lm"])
    args = ap.parse_args()
    try:
        import mlx_lm  # noqa: F401
        if "llama.cpp" not in args.skip:
            import gguf  # noqa: F401
            import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    print("command: " + " ".join(sys.argv))
    # on a loaded machine every contender slows, unevenly: say how loaded it was
    print(f"machine: {machine()}; load average at start: {load_average()}", flush=True)
    args.bandwidth = bandwidth()

    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            bench_config(config, args, Path(tmp))
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
