"""Peak memory of `executorch-mlx export` against the size of the model.

    .venv/bin/python benchmarks/bench_export_memory.py                  # ~0.15B and ~1.5B
    .venv/bin/python benchmarks/bench_export_memory.py --sizes 8b --dtype bf16
    .venv/bin/python benchmarks/bench_export_memory.py --external-weights   # weights in a .ptd

Writes random bfloat16 Llama folders (safetensors shards of at most 2 GB,
written one tensor at a time) and exports each in a fresh process; prints
that process's peak resident set size (ru_maxrss) above the peak of a
process that only imports what export imports (torch, transformers,
ExecuTorch's exir, our package), the figure the goal is stated in.

Sizes: 0.15b (16 layers, hidden 768), 1.5b (22 layers, hidden 2048) and
8b (Llama-3-8B's shape: 32 layers, hidden 4096, vocab 128256; 16 GB on
disk, so only when asked). Export flags: --quantize int4 (group 64) and
--max-context 128 by default, as in the issue that set the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (layers, hidden, intermediate, heads, kv heads, vocab)
SIZES = {
    "0.15b": (16, 768, 2048, 12, 4, 32000),
    "1.5b": (22, 2048, 8192, 16, 8, 32000),
    "8b": (32, 4096, 14336, 32, 8, 128256),
}
SHARD_BYTES = 2 << 30
IMPORTS = "import torch, transformers, executorch.exir, executorch_mlx.cli"


def write_folder(path: Path, size: str) -> tuple[Path, int]:
    """A Llama folder of random bf16 weights; returns it and its parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    layers, hidden, intermediate, heads, kv_heads, vocab = SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    path.mkdir(parents=True)
    cfg.to_json_file(path / "config.json")
    generator = torch.Generator().manual_seed(0)
    shards: list[list[str]] = [[]]
    current: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if current and sum(t.nbytes for t in current.values()) + shape.numel() * 2 > SHARD_BYTES:
            save_file(current, str(path / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
            current, shards = {}, shards + [[]]
        ones = name.endswith("norm.weight")
        current[name] = (torch.ones(shape) if ones else torch.randn(shape, generator=generator) * 0.02
                         ).to(torch.bfloat16)
        shards[-1].append(name)
    save_file(current, str(path / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, f in enumerate(files):
        os.replace(path / f"shard-{i + 1}.safetensors", path / f)
    index = {"metadata": {}, "weight_map": {k: f for names, f in zip(shards, files) for k in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, sum(s.numel() for s in shapes.values())


def peak_rss(command: list[str]) -> tuple[float, float]:
    """(peak RSS in GB, seconds) of a command run to its end. A child's
    ru_maxrss starts from its parent's peak (Linux keeps it across the exec),
    so this process stays small: it imports no torch and writes the folders
    in children of their own."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            errors.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed: {errors.read()[-2000:]}")
    return usage.ru_maxrss / 2**20, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=["0.15b", "1.5b"])
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--quantize", default="int4", help="int4, int8 or none")
    parser.add_argument("--max-context", type=int, default=128)
    parser.add_argument("--external-weights", action="store_true", help="export --external-weights (a .ptd)")
    parser.add_argument("--write", nargs=2, metavar=("SIZE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        _, params = write_folder(Path(args.write[1]), args.write[0])
        print(params)
        return 0

    base, _ = peak_rss([sys.executable, "-c", IMPORTS])
    print(f"bare import ({IMPORTS}): peak {base:.2f} GB", flush=True)
    external = " --external-weights" if args.external_weights else ""
    print(f"export --dtype {args.dtype} --quantize {args.quantize} --max-context {args.max_context}{external}\n",
          flush=True)
    print("| model | bf16 on disk | .pte | export peak | above import | seconds |")
    print("|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="emlx_mem_", dir=os.environ.get("BENCH_DIR")) as tmp:
        for size in args.sizes:
            folder = Path(tmp) / size
            params = int(subprocess.run([sys.executable, __file__, "--write", size, str(folder)], check=True,
                                        capture_output=True, text=True).stdout.split()[-1])
            disk = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
            out = Path(tmp) / f"{size}.pte"
            command = [sys.executable, "-m", "executorch_mlx.cli", "export", str(folder), "-o", str(out),
                       "--dtype", args.dtype, "--max-context", str(args.max_context), "--quiet"]
            if args.quantize != "none":
                command += ["--quantize", args.quantize]
            if args.external_weights:
                command.append("--external-weights")
            peak, seconds = peak_rss(command)
            data = out.with_suffix(".ptd")
            written = f"{out.stat().st_size / 1e9:.2f} GB" + (
                f" + .ptd {data.stat().st_size / 1e9:.2f} GB" if data.exists() else "")
            print(f"| {size} ({params / 1e9:.2f}B parameters) | {disk:.2f} GB | {written} "
                  f"| {peak:.2f} GB | +{peak - base:.2f} GB | {seconds:.0f} |", flush=True)
            for f in folder.iterdir():
                f.unlink()
            out.unlink()
            data.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
