"""Writes a Hugging Face Llama folder (safetensors, float32) as a GGUF file
for llama.cpp, in F32, Q8_0, Q4_0 or Q5_0, so that bench_llm.py can run the same
weights on llama.cpp. Benchmark-only: it needs the `gguf` package (bench
extra) and handles the plain Llama layout bench_llm.py writes.

The vocabulary is placeholder tokens: the benchmark feeds token ids, never
text. Query and key rows are permuted from Hugging Face's rotate-half RoPE
layout to llama.cpp's interleaved one (what llama.cpp's own converter does
for Llama).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QUANT_TYPES = ("F32", "Q8_0", "Q4_0", "Q5_0")


def _interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection, per head, from [first halves, second halves]
    of each rotated pair to pairs side by side."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: str | Path, out: str | Path, quant: str = "F32") -> Path:
    import gguf
    from safetensors.numpy import load_file

    if quant not in QUANT_TYPES:
        raise ValueError(f"quant must be one of {QUANT_TYPES}, not {quant!r}")
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise NotImplementedError(f"gguf_folder writes Llama folders only, not {cfg.get('model_type')!r}")
    weights: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(f))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("executorch-mlx benchmark model")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0}[quant])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)

    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def add(name: str, tensor: np.ndarray) -> None:
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if tensor.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:  # norms stay float32, as llama.cpp's converter keeps them
            w.add_tensor(name, tensor)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights and not cfg.get("tie_word_embeddings", False):
        add("output.weight", weights["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", _interleave_rope_rows(weights[p + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", _interleave_rope_rows(weights[p + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
