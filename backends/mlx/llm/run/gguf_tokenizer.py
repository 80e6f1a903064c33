"""A GGUF file's vocabulary as a tokenizer folder.

llama.cpp's files carry their tokenizer (tokenizer.ggml.*: the tokens, BPE
merges or sentencepiece scores, token types, special token ids, the chat
template). transformers converts it to a fast tokenizer
(`AutoTokenizer.from_pretrained(..., gguf_file=...)`); saved to a folder,
it is what every runner reads from a Hugging Face folder: tokenizer.json,
the eos token and the chat template in tokenizer_config.json. So
`LLMRunner(pte, "model.gguf")` (and `--tokenizer model.gguf`) need no
other download.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def gguf_tokenizer_folder(path: str | Path) -> tempfile.TemporaryDirectory:
    """A temporary folder holding the file's tokenizer (removed with the returned object)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read a tokenizer from {path}: {str(e).strip().splitlines()[0]}") from e
    folder = tempfile.TemporaryDirectory(prefix="emlx-gguf-tokenizer-")
    tokenizer.save_pretrained(folder.name)
    return folder
