"""GGUF files in (llm/export/gguf_files.py): tiny Llama and Qwen3 folders
written as GGUF with the gguf package (benchmarks/gguf_folder.py: llama.cpp's
names, Llama's interleaved rotary rows, Q8_0/Q4_0 by gguf's own quantizer,
the folder's vocabulary), exported, and held to the same model run by
transformers on the GGUF's values (dequantized by the gguf package): Q8_0
and Q4_0 are repacked exactly; the file's vocabulary is the folder's
tokenizer (llm/run/gguf_tokenizer.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import write_model_folder
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = "The quick brown fox"
_spec = importlib.util.spec_from_file_location("gguf_folder", Path(__file__).parents[1] / "benchmarks/gguf_folder.py")
gguf_folder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # tied embeddings: the GGUF has no output tensor, llama.cpp's way of tying them
    return write_model_folder(tmp_path_factory.mktemp("gguf") / "f32", "llama", layers=1, hidden=64,
                              intermediate=128)


def gguf_values_folder(folder: Path, gguf_path: Path, out: Path) -> Path:
    """`folder` with every weight replaced by the GGUF's dequantized value."""
    import gguf
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.export.gguf_files import _halves, _hf_name

    config = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    state = model.state_dict()
    interleaved = config["model_type"] == "llama"  # (llama.cpp's rotary rows: Llama's only)
    for t in gguf.GGUFReader(gguf_path).tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") and interleaved else ""
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(kind)
        state[_hf_name(t.name)].copy_(torch.from_numpy(np.array(_halves(values, heads) if heads else values)))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_a_gguf_file_exports_and_generates_its_values(llama, tmp_path, quant):
    path = gguf_folder.write_gguf(llama, tmp_path / "model.gguf", quant)
    pte = export_llm(path, tmp_path / "model.pte", ExportOptions(max_context=64), progress=None)
    runner = LLMRunner(pte, llama)
    assert runner.contract.metadata["emlx_quantization"] == [f"gguf: 8 {quant}"]
    ids = runner.tokenizer.encode(PROMPT).ids
    want_folder = gguf_values_folder(llama, path, tmp_path / "values")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(want_folder).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert runner.generate(PROMPT, max_new_tokens=16).token_ids == want


def test_a_qwen3_file_with_its_vocabulary(tmp_path):
    """Qwen3 (its own head size, query and key norms, no interleaved rows)
    in Q8_0, run with the tokenizer read from the file itself."""
    folder = write_model_folder(tmp_path / "qwen3", "qwen3", layers=1, hidden=64, intermediate=128)
    path = gguf_folder.write_gguf(folder, tmp_path / "qwen3.gguf", "Q8_0")
    pte = export_llm(path, tmp_path / "qwen3.pte", ExportOptions(max_context=64), progress=None)
    runner = LLMRunner(pte, path)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    assert runner.tokenizer.encode(PROMPT).ids == ids and len(ids) > 3
    assert runner.eos_ids == LLMRunner(pte, folder).eos_ids
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_values_folder(folder, path, tmp_path / "values")).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert runner.generate(PROMPT, max_new_tokens=16, temperature=0).token_ids == want


def test_other_types_are_quantized_again_and_said_so(llama, tmp_path):
    """Q5_0 (not MLX's layout): dequantized, then quantized by MLX at 5 bits
    in groups of 32 (the tables --quantize int5 --group-size 32 makes of the
    dequantized values), and the loader says it is not exact."""
    import gguf

    from executorch_mlx.llm.export.gguf_files import load_gguf
    from executorch_mlx.custom_kernel_ops.quantized import QuantFormat
    from executorch_mlx.llm.export.quantize import quantize_weight

    path = gguf_folder.write_gguf(llama, tmp_path / "model.gguf", "Q5_0")
    said = []
    model = load_gguf(path, torch.float32, said.append)
    assert said == ["Q5_0 tensors dequantized and quantized again to 5 bits in groups of 32 (not exact)"]
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    table = model.model.layers[0].mlp.down_proj.table
    want = quantize_weight(torch.from_numpy(np.array(values)), QuantFormat(5, 32))
    assert table.fmt == QuantFormat(5, 32)
    assert all(torch.equal(got, w) for got, w in zip((table.qweight, table.scales, table.biases), want))


def test_gguf_refusals(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="GGUF architecture 'mamba' is not read yet"):
        export_llm(tmp_path / "m.gguf", tmp_path / "m.pte", progress=None)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        export_llm(tmp_path / "bad.gguf", tmp_path / "m.pte", progress=None)
