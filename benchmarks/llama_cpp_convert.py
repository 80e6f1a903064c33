#!/usr/bin/env python3
"""Runs llama.cpp's own converter (convert_hf_to_gguf.py) on a Hugging Face
folder, for the benchmarks that hold our programs against llama.cpp on the
same weights in architectures our `gguf_folder.py` does not write (Qwen3.5,
LFM2, ...).

    python benchmarks/llama_cpp_convert.py LLAMA_CPP_SRC MODEL_DIR --outfile F.gguf --outtype f32 [--no-mtp]

LLAMA_CPP_SRC is a llama.cpp source tree, such as the one llama-cpp-python's
source distribution carries (`vendor/llama.cpp` of the bench extra's
version): its converter and its own gguf-py, which may be newer than the
`gguf` we pin. Benchmark folders carry a small trained tokenizer the
converter does not know by hash; the benchmarks feed token ids, never text,
so it is written as a known BPE pre-tokenizer ("qwen2") instead of refused.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    src = sys.argv.pop(1)
    sys.path[:0] = [src, f"{src}/gguf-py"]
    from conversion import base  # the converter's package, from `src`

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv[0] = f"{src}/convert_hf_to_gguf.py"
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
