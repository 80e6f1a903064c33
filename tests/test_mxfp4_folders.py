"""Hugging Face folders with MXFP4 experts (gpt-oss's checkpoints,
llm/export/mxfp4_folders.py): written here as OpenAI's are (each experts
projection as `_blocks` and `_scales`, config.json's quantization_config),
then exported as they are: the blocks' bytes are in the .pte, and the
program generates what transformers' own dequantization of the folder
generates.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import write_model_folder
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = [3, 17, 42, 5, 99, 7]


def write_mxfp4_folder(src, dst):
    """`src` (a float32 gpt-oss folder) with its experts in MXFP4: a
    projection [E, K, N] as blocks uint8 [E, N, K / 32, 16] and scales uint8
    [E, N, K / 32] (MLX's quantization of the same values)."""
    shutil.copytree(src, dst)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = w
            continue
        experts, k, n = w.shape
        packed, scales = mx.quantize(mx.array(np.ascontiguousarray(w.transpose(0, 2, 1)).reshape(-1, k)),
                                     group_size=32, bits=4, mode="mxfp4")
        out[f"{name}_blocks"] = np.array(packed).view(np.uint8).reshape(experts, n, k // 32, 16)
        out[f"{name}_scales"] = np.array(scales).reshape(experts, n, k // 32)
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return write_mxfp4_folder(write_model_folder(root / "f32", "gpt_oss", layers=2), root / "mxfp4")


def transformers_reading(folder, tensors):
    """The float model transformers makes of the folder: its own MXFP4
    dequantization (transformers.integrations.mxfp4) of each projection."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # (its loader wants accelerate; the conversion is the same function)
    model = AutoModelForCausalLM.from_config(config).eval()
    state = {k: torch.from_numpy(v) for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for name in (k.removesuffix("_blocks") for k in tensors if k.endswith("_blocks")):
        state[name] = convert_moe_packed_tensors(torch.from_numpy(tensors[f"{name}_blocks"]),
                                                 torch.from_numpy(tensors[f"{name}_scales"]), dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model


def test_mxfp4_experts_export_as_they_are(gpt_oss, tmp_path):
    folder, tensors = gpt_oss
    pte = export_llm(folder, tmp_path / "mxfp4.pte", ExportOptions(max_context=64), progress=None)
    data = pte.read_bytes()
    blocks = [v for k, v in tensors.items() if k.endswith(("_blocks", "_scales"))]
    assert len(blocks) == 8 and all(v.tobytes() in data for v in blocks), "the folder's blocks and scales, unchanged"
    runner = LLMRunner(pte, folder)
    assert runner.contract.metadata["emlx_quantization"] == ["mxfp4 experts"]
    with torch.no_grad():
        want = transformers_reading(folder, tensors).generate(torch.tensor([PROMPT]), max_new_tokens=12,
                                                               do_sample=False)[0, len(PROMPT):].tolist()
    assert runner.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids == want


def test_broken_blocks_are_named(gpt_oss, tmp_path):
    folder, tensors = gpt_oss
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({**tensors, f"{name}_scales": tensors[f"{name}_scales"][:, :, :1].copy()},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}_blocks uint8 \[4, 64, 4, 16\] and _scales uint8 \[4, 64, 1\] "
                                         r"are not MXFP4 of a \[4, 64, 128\] projection"):
        export_llm(bad, tmp_path / "bad.pte", ExportOptions(max_context=64), progress=None)
    assert not (tmp_path / "bad.pte").exists()
