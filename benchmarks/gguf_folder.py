"""Writes a Hugging Face Llama, Qwen2 or Qwen3 folder (safetensors,
float32) as a GGUF file for llama.cpp, in F32, Q8_0, Q4_0 or Q5_0, with
llama.cpp's names, so that bench_llm.py can run the same weights on
llama.cpp and tests/test_gguf.py can read such a file. It needs the `gguf`
package.

The vocabulary is the folder's byte-level BPE (tokens, merges, special
tokens as control tokens: llama.cpp's "gpt2" tokenizer) where it has a
tokenizer.json, else placeholder tokens (the benchmark feeds token ids,
never text). Llama's query and key rows are permuted from Hugging Face's
rotate-half RoPE layout to llama.cpp's interleaved one (what llama.cpp's
own converter does for Llama; not for Qwen, whose RoPE it runs as
Hugging Face does).
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


def _add_vocabulary(w, folder: Path, cfg: dict, vocab: int) -> None:
    import gguf

    tokenizer = folder / "tokenizer.json"
    model = json.loads(tokenizer.read_text())["model"] if tokenizer.is_file() else {}
    if model.get("type") != "BPE":
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(vocab)])
        w.add_token_scores([0.0] * vocab)
        w.add_token_types([gguf.TokenType.NORMAL] * vocab)
        return
    added = {t["id"]: t for t in json.loads(tokenizer.read_text())["added_tokens"]}
    tokens = {**{i: t for t, i in model["vocab"].items()}, **{i: t["content"] for i, t in added.items()}}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([tokens[i] for i in range(len(tokens))])
    w.add_token_types([gguf.TokenType.CONTROL if added.get(i, {}).get("special") else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    for key in ("bos", "eos"):
        if isinstance(cfg.get(f"{key}_token_id"), int):
            getattr(w, f"add_{key}_token_id")(cfg[f"{key}_token_id"])


def write_gguf(folder: str | Path, out: str | Path, quant: str = "F32") -> Path:
    import gguf
    from safetensors.numpy import load_file

    if quant not in QUANT_TYPES:
        raise ValueError(f"quant must be one of {QUANT_TYPES}, not {quant!r}")
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg.get("model_type")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise NotImplementedError(f"gguf_folder writes Llama, Qwen2 and Qwen3 folders, not {arch!r}")
    weights: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(f))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]

    head_dim = cfg.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("executorch-mlx benchmark model")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0}[quant])
    _add_vocabulary(w, folder, cfg, vocab)

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
    rope = _interleave_rope_rows if arch == "llama" else (lambda rows, heads: rows)
    for i in range(layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        for name, kind, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0)):
            for part in ("weight", "bias"):
                if f"{p}self_attn.{name}.{part}" in weights:
                    value = weights[f"{p}self_attn.{name}.{part}"]
                    add(f"blk.{i}.{kind}.{part}", rope(value, n) if n else value)
        for norm in ("q_norm", "k_norm"):
            if f"{p}self_attn.{norm}.weight" in weights:
                add(f"blk.{i}.attn_{norm}.weight", weights[f"{p}self_attn.{norm}.weight"])
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
