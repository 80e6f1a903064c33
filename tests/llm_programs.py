"""The Hugging Face programs that several test files use, built once per run
(conftest.SharedBuilds): one tiny random folder per family, exported with a
sampler or logits-only at MAX_CONTEXT."""

from __future__ import annotations

from pathlib import Path

from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import write_model_folder

MAX_CONTEXT = 128

# Layers per family folder. A family's own ops and patterns show in one layer
# (an export costs ~6 s a layer on the CI machine); what takes two, the cache
# of one layer kept apart from the next's and the residual stream across
# them, is Llama's (the program most tests use), and Gemma 3 alternates
# sliding-window and full layers.
# (the hybrids: a state and an attention layer; Llama 4 and Gemma 4: their two kinds of attention; Gemma 3n: a
# third layer that shares the first one's keys and values)
FAMILY_LAYERS = {"llama": 2, "gemma3": 2, "qwen3_5_text": 2, "lfm2": 2, "qwen3_5_moe_text": 2, "lfm2_moe": 2,
                 "granitemoehybrid": 2, "nemotron_h": 2, "jamba": 2, "llama4_text": 2, "gemma4_text": 2, "gemma3n_text": 3}

# The state-layer tests' families: gated delta, convolution, Mamba-2 (each with attention).
HYBRIDS = ("qwen3_5_text", "lfm2", "granitemoehybrid")
# Families whose sampled program some test uses; the family test takes those and the logits program of the rest
# (the sampler costs ~3 s of each export, and its ops do not depend on the family).
SAMPLED = {"llama", "qwen2", "qwen3", "gemma3", *HYBRIDS}


def family_program(shared, family: str, sampling: bool = True) -> tuple[Path, Path]:
    """(the model folder, the .pte). Llama's sampling program also returns
    each token's log-probability: tests/test_llm.py checks those on it, and
    the other families cover programs without."""

    def build(root: Path) -> tuple[Path, Path]:
        # the folder is the family's own, whichever program is built first
        folder = shared.get(family, lambda r: write_model_folder(r / family, family,
                                                                layers=FAMILY_LAYERS.get(family, 1)))
        pte = export_llm(folder, root / "program.pte",
                         ExportOptions(max_context=MAX_CONTEXT, sampling=sampling,
                                       logprobs=sampling and family == "llama"),
                         progress=None)
        return folder, pte

    return shared.get(f"{family}-{'sampled' if sampling else 'logits'}", build)


def draft_program(shared) -> tuple[Path, Path]:
    """A one-layer Llama of the same tokenizer as the family programs: a draft model."""

    def build(root: Path) -> tuple[Path, Path]:
        folder = write_model_folder(root / "draft", "llama", layers=1, hidden=32, heads=2, kv_heads=1,
                                    intermediate=64, seed=1)
        return folder, export_llm(folder, root / "draft.pte", ExportOptions(max_context=MAX_CONTEXT), progress=None)

    return shared.get("llama-draft", build)


def chat_program(shared, max_context: int, tools: bool = False) -> tuple[Path, Path]:
    """A one-layer Qwen2 chat folder (the README's MODEL_DIR) and its program
    with logprobs and the 5 most likely tokens of each step (model.pte): its
    vocabulary has the two chat tokens more (`tools`: and tool-call text)."""

    def build(root: Path) -> tuple[Path, Path]:
        folder = write_model_folder(root / "MODEL_DIR", "qwen2", layers=1, hidden=32, heads=2, kv_heads=1,
                                    intermediate=64, chat=True, tools=tools)
        return folder, export_llm(folder, root / "model.pte", ExportOptions(max_context=max_context, top_logprobs=5),
                                  progress=None)

    return shared.get(f"qwen2-chat-{max_context}{'-tools' if tools else ''}", build)


# The context of the chat programs the server tests use (room for the tools the template lists).
SERVE_CONTEXT = 512


def batched_chat_program(shared) -> tuple[Path, Path, Path]:
    """chat_program's folder (with tools) exported with --max-batch 4 and the
    5 most likely tokens of each step, as its one-row program:
    (the folder, the batched program, the one-row program)."""
    folder, single = chat_program(shared, SERVE_CONTEXT, tools=True)

    def build(root: Path) -> Path:
        return export_llm(folder, root / "batched.pte",
                          ExportOptions(max_context=SERVE_CONTEXT, top_logprobs=5, max_batch=4), progress=None)

    return folder, shared.get(f"qwen2-chat-{SERVE_CONTEXT}-tools-batch4", build), single
