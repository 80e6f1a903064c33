"""The Hugging Face programs that several test files use, built once per run
(conftest.SharedBuilds): one tiny random folder per family, exported with a
sampler or logits-only at MAX_CONTEXT."""

from __future__ import annotations

from pathlib import Path

from executorch_mlx.llm.hf_export import export_llm
from executorch_mlx.llm.model_folders import write_model_folder

MAX_CONTEXT = 128


def family_program(shared, family: str, sampling: bool = True) -> tuple[Path, Path]:
    """(the model folder, the .pte). Llama's sampling program also returns
    each token's log-probability: tests/test_llm.py checks those on it, and
    the other families cover programs without."""

    def build(root: Path) -> tuple[Path, Path]:
        # the folder is the family's own, whichever program is built first
        folder = shared.get(family, lambda r: write_model_folder(r / family, family))
        pte = export_llm(folder, root / "program.pte", max_context=MAX_CONTEXT, sampling=sampling,
                         logprobs=sampling and family == "llama", progress=None)
        return folder, pte

    return shared.get(f"{family}-{'sampled' if sampling else 'logits'}", build)
