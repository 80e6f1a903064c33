"""mlx-lm's quantized folders (llm/export/mlx_folders.py): written here as
`mlx_lm.convert -q` writes them (mx.quantize of every linear layer and of
the embedding, uint32 packed weights, config.json's "quantization"), then
exported as they are: the packed bytes in the .pte are the folder's, and
the program generates what the same weights quantized by export generate.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from executorch_mlx.inspector import delegate_graphs
from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import write_model_folder
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = "The quick brown fox"


def write_mlx_folder(src, dst, bits: int, group_size: int, layers: dict | None = None, mode: str = "affine"):
    """`src` (a float32 folder) as mlx-lm's converter writes it; `layers`:
    per-layer entries of "quantization" ({name: {"bits", "group_size"}} or
    {name: False}); mode "mxfp4": uint8 scales and no biases."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        layer = name.removesuffix(".weight")
        own = (layers or {}).get(layer, {"bits": bits, "group_size": group_size})
        if w.ndim != 2 or own is False or not (name.endswith("proj.weight") or "embed_tokens" in name):
            out[name] = w
            continue
        packed, scales, *biases = mx.quantize(mx.array(w), group_size=own["group_size"], bits=own["bits"], mode=mode)
        out[name] = np.array(packed)  # uint32, as mlx-lm saves it
        out[f"{layer}.scales"] = np.array(scales)
        if biases:
            out[f"{layer}.biases"] = np.array(biases[0])
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"group_size": group_size, "bits": bits,
                                                              "mode": mode, **(layers or {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("llama") / "f32", "llama", layers=1, hidden=64,
                              intermediate=128)


def quantized_linear_flags(pte_bytes: bytes) -> set[bool]:
    return {n.op.float_activations for g in delegate_graphs(pte_bytes) for n in g.nodes
            if type(n.op).__name__ == "QuantizedLinearNode"}


def as_bf16_params(folder):
    """The folder's scales and biases rounded to bfloat16, as mlx-lm saves a
    bfloat16 model's."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    path = folder / "model.safetensors"
    tensors = load_torch(str(path))
    tensors = {k: v.to(torch.bfloat16) if k.endswith((".scales", ".biases")) else v for k, v in tensors.items()}
    save_torch(tensors, str(path), metadata={"format": "mlx"})
    return tensors


def test_an_mlx_lm_folder_keeps_its_bfloat16_scales_in_a_float32_program(llama, tmp_path):
    """bfloat16 scales and biases are kept as they are (our kernel reads them
    under float32 x: half the bytes of widened ones), and compute what our
    own export with bfloat16 scales does from the same float32 weights."""
    folder = write_mlx_folder(llama, tmp_path / "mlx", 4, 64)
    tensors = as_bf16_params(folder)
    pte = export_llm(folder, tmp_path / "mlx.pte", ExportOptions(max_context=64, activations="int8"), progress=None)
    data = pte.read_bytes()
    scales = [v for k, v in tensors.items() if k.endswith(".scales")]
    assert scales and all(v.view(torch.int16).numpy().tobytes() in data for v in scales), \
        "the folder's bfloat16 scales, unchanged"
    ours = export_llm(llama, tmp_path / "ours.pte",
                      ExportOptions(max_context=64, quantize="int4", quantize_embedding=True, scales_dtype="bf16"),
                      progress=None)
    assert len(data) < len(ours.read_bytes()) * 1.01
    want = LLMRunner(ours, llama).generate(PROMPT, max_new_tokens=16).token_ids
    assert LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=16).token_ids == want


def test_an_mlx_lm_folder_exports_as_it_is(llama, tmp_path, bits=4):
    """Its layers meet x in floats, as mlx-lm computes (int8 on request).
    (8 bits takes the same path: benchmarks/check_mlx_lm_folders.py runs
    both against mlx-lm.)"""
    folder = write_mlx_folder(llama, tmp_path / "mlx", bits, 64)
    pte = export_llm(folder, tmp_path / "mlx.pte", ExportOptions(max_context=64), progress=None)
    data = pte.read_bytes()
    packed = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if v.dtype == np.uint32}
    assert packed and all(v.tobytes() in data for v in packed.values()), "the folder's packed weights, unchanged"
    ours = export_llm(llama, tmp_path / "ours.pte",
                      ExportOptions(max_context=64, quantize=f"int{bits}", quantize_embedding=True,
                                    activations="float", scales_dtype="dtype"),  # (the folder's: float32)
                      progress=None)
    want = LLMRunner(ours, llama).generate(PROMPT, max_new_tokens=16).token_ids
    runner = LLMRunner(pte, folder)
    assert runner.generate(PROMPT, max_new_tokens=16).token_ids == want
    assert runner.contract.metadata["emlx_quantization"] == [f"mlx-lm int{bits} group 64, float activations"]
    assert quantized_linear_flags(data) == {True}
    rounded = export_llm(folder, tmp_path / "int8.pte", ExportOptions(max_context=64, activations="int8"),
                         progress=None)
    assert quantized_linear_flags(rounded.read_bytes()) == {False}
    assert LLMRunner(rounded).contract.metadata["emlx_quantization"] == [f"mlx-lm int{bits} group 64"]


def test_an_mxfp4_folder_exports_as_it_is(llama, tmp_path):
    """`mlx_lm.convert --q-mode mxfp4`: uint8 scales, no biases, the
    embedding too; greedy ids against the same model quantized by
    quantize_model and run eagerly (the ops' references)."""
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.export.quantize import quantize_format, quantize_model

    folder = write_mlx_folder(llama, tmp_path / "mxfp4", 4, 32, mode="mxfp4")
    pte = export_llm(folder, tmp_path / "mxfp4.pte", ExportOptions(max_context=64), progress=None)
    data = pte.read_bytes()
    stored = load_file(str(folder / "model.safetensors"))
    quantized = [v for v in stored.values() if v.dtype in (np.uint32, np.uint8)]
    assert len(quantized) == 16 and all(v.tobytes() in data for v in quantized), "the folder's bytes, unchanged"
    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    quantize_model(model, quantize_format("mxfp4"), embedding=True)
    ids = [3, 17, 42, 5, 99, 7]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    runner = LLMRunner(pte, folder)
    assert runner.generate(ids, max_new_tokens=12, temperature=0).token_ids == want
    assert runner.contract.metadata["emlx_quantization"] == ["mlx-lm mxfp4, float activations"]


def test_per_layer_entries_and_refusals(llama, tmp_path):
    """A layer at its own width (3 bits: MLX's kernels) and one left in full
    precision; what export does not read is named."""
    down = "model.layers.0.mlp.down_proj"
    folder = write_mlx_folder(llama, tmp_path / "mixed", 4, 64, {down: {"bits": 3, "group_size": 32},
                                                                 "model.layers.0.mlp.up_proj": False})
    pte = export_llm(folder, tmp_path / "mixed.pte", ExportOptions(max_context=64), progress=None)
    runner = LLMRunner(pte, folder)
    assert runner.contract.metadata["emlx_quantization"] == ["mlx-lm int4 group 64 (2 layers differ), float activations"]
    assert len(runner.generate(PROMPT, max_new_tokens=4).token_ids) == 4
    with pytest.raises(ValueError, match="already quantized .*leave out quantize"):
        export_llm(folder, tmp_path / "q.pte", ExportOptions(max_context=64, quantize="int4"), progress=None)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"][down]["bits"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=f"{down}: 7-bit weights in groups of 32"):
        export_llm(folder, tmp_path / "seven.pte", ExportOptions(max_context=64), progress=None)
    config["quantization"][down]["bits"] = 3
    config["quantization"]["mode"] = "nvfp4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="'nvfp4' quantization is not read yet"):
        export_llm(folder, tmp_path / "fp4.pte", ExportOptions(max_context=64), progress=None)
