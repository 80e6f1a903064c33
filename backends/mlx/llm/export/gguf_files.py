"""GGUF files (llama.cpp's format) in: `executorch-mlx export MODEL.gguf`.

The file's metadata becomes a Hugging Face config, its tensors the model's
weights, read one at a time (lowering/weight_files.py):

- F32, F16 and BF16 tensors are read as they are (cast to --dtype).
- Q8_0 and Q4_0 are MLX's affine layout in other words: blocks of 32 values
  with one float16 scale, w = d * q (q in [-128, 127]) and w = d * (q - 8)
  (q in [0, 15]). They are repacked, not requantized, into 8- and 4-bit
  groups of 32 with scale d and bias -128 d or -8 d: exact (the float16
  scales widen exactly to float32; --dtype bf16 rounds them).
- Every other type (the K-quants, ...) is dequantized with the gguf package
  and quantized again by MLX at the nearest width it has (Q2_K -> 2 bits,
  Q3_K -> 3, Q4_1 and Q4_K -> 4, Q5_0, Q5_1 and Q5_K -> 5, Q6_K -> 6, anything
  else -> 8), in groups of 32: not exact, and export says so.

The architectures read so far (general.architecture): llama (Llama,
Mistral, SmolLM; llama.cpp interleaves their query and key rows for its
rotary layout, put back here into Hugging Face's halves), qwen2 (with the
projections' biases) and qwen3 (with its query and key norms); others are
refused by name. The vocabulary stays in the file: runners read it from
there (`--tokenizer MODEL.gguf`, llm/run/gguf_tokenizer.py) or from a
Hugging Face tokenizer folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...custom_kernel_ops.quantized import QuantFormat
from ...lowering.weight_files import keep
from .mlx_folders import parameters_on_meta, replace_module
from .quantize import QuantizedLinear, QuantizedTable
from .streamed_load import release_mapped_pages

# general.architecture -> (transformers' model type and class, whether llama.cpp interleaved q/k rows)
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM", True), "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM", False)}
# llama.cpp's per-layer names -> transformers' names (Llama's layout, and Qwen3's norms)
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
REQUANTIZED_BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}
GROUP = 32


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"{path} is not a GGUF file gguf can read ({e})") from e


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(path: str | Path, reader=None) -> dict:
    """The Hugging Face config.json a GGUF file's metadata describes
    (`reader`: the file already opened)."""
    path = Path(path)
    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise NotImplementedError(f"{path}: GGUF architecture {arch!r} is not read yet (read: {', '.join(ARCHITECTURES)})")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    model_type, architecture, _ = ARCHITECTURES[arch]
    config = {
        "model_type": model_type, "architectures": [architecture],
        "vocab_size": int(embed.shape[1]), "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        # (llama.cpp writes key_length where the head size is not hidden / heads, as in Qwen3)
        "head_dim": int(_field(reader, f"{arch}.attention.key_length",
                               _field(reader, f"{arch}.rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch != "qwen2":  # (Qwen2's projections always have biases)
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    for key in ("bos", "eos", "padding"):
        token = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token)
    return config


def _hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in NAMES:
        return f"{NAMES[parts[0]]}.{parts[1]}"
    raise NotImplementedError(f"GGUF tensor {name} has no transformers counterpart")


def _halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query/key projection (or its scales, biases, codes) from
    llama.cpp's interleaved rotary pairs back to Hugging Face's halves."""
    return rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _repacked(qtype: str, data: np.ndarray, rows: int, width: int):
    """(packed uint32 [N, K*bits/32], scales [N, K/32], biases, bits) of a Q8_0 or Q4_0 tensor."""
    blocks = data.reshape(rows, width // GROUP, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(rows, width).view(np.uint32), d, -128 * d, 8
    low, high = blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4  # llama.cpp: value j low, value j + 16 high
    codes = np.concatenate([low, high], axis=-1).reshape(rows, width)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # MLX: value i at nibble i
    return np.ascontiguousarray(packed).view(np.uint32), d, -8 * d, 4


def load_gguf(path: str | Path, dtype: torch.dtype, say=lambda _: None):
    """The model of a GGUF file, its Q8_0/Q4_0 layers repacked (and other
    quantized types requantized) as QuantizedTable/QuantizedLinear."""
    from gguf import GGMLQuantizationType, quants
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    reader = _reader(path)
    config = gguf_config(path, reader)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype).eval()
    interleaved = ARCHITECTURES[_field(reader, "general.architecture")][2]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} if interleaved else {}
    requantized: dict[str, int] = {}
    tables: dict[str, QuantizedTable] = {}
    to_torch = lambda a: keep(torch.from_numpy(np.ascontiguousarray(a)).to(dtype))  # noqa: E731
    for tensor in reader.tensors:
        name, qtype = _hf_name(tensor.name), tensor.tensor_type.name
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        rows = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
        width = int(tensor.shape[0])
        permute = heads.get(tensor.name.split(".")[2]) if tensor.name.startswith("blk.") else None
        fix = (lambda a: _halves(a, permute)) if permute else (lambda a: a)
        if qtype in ("Q8_0", "Q4_0") and attr == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            packed, scales, biases, bits = _repacked(qtype, np.asarray(tensor.data), rows, width)
            table = QuantizedTable(None, QuantFormat(bits, GROUP), tables=(
                keep(torch.from_numpy(fix(packed).view(np.int32).copy())), to_torch(fix(scales)), to_torch(fix(biases))))
        elif qtype in ("F32", "F16", "BF16"):
            values = np.asarray(tensor.data)
            values = (torch.from_numpy(values.copy().view(np.int16)).view(torch.bfloat16) if qtype == "BF16"
                      else torch.from_numpy(values.astype(np.float32)))
            shape = tuple(reversed([int(s) for s in tensor.shape]))
            values = values.reshape(shape)
            if permute:
                values = torch.from_numpy(fix(values.float().numpy()))
            setattr(module, attr, torch.nn.Parameter(keep(values.to(dtype)), requires_grad=False))
            release_mapped_pages(path)
            continue
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            bits = REQUANTIZED_BITS.get(qtype, 8)
            values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType[qtype]).reshape(rows, width)
            requantized[qtype] = bits
            table = QuantizedTable(torch.from_numpy(fix(values).astype(np.float32)).to(dtype), QuantFormat(bits, GROUP))
        else:
            raise NotImplementedError(f"{path}: {tensor.name} is {qtype}, which export reads for linear layers only")
        tables[module_name] = table
        # (a bias read before its weight is on the module already)
        bias = getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) and bias.device.type != "meta" else None
        replace_module(model, module_name, table if isinstance(module, torch.nn.Embedding)
                       else QuantizedLinear(table, bias))
        release_mapped_pages(path)
    if config["tie_word_embeddings"]:
        embed = "model.embed_tokens"
        if embed in tables:
            replace_module(model, "lm_head", QuantizedLinear(tables[embed], None))
        else:
            model.tie_weights()
    for qtype, bits in sorted(requantized.items()):
        say(f"{qtype} tensors dequantized and quantized again to {bits} bits in groups of {GROUP} (not exact)")
    missing = sorted(n for n, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise ValueError(f"{path}: tensors missing from the file: {', '.join(missing[:8])}")
    return model


def describe(path: str | Path) -> str:
    """The program contract's quantization string: the file's tensor types."""
    from collections import Counter

    types = Counter(t.tensor_type.name for t in _reader(Path(path)).tensors if len(t.shape) > 1)
    return "gguf: " + ", ".join(f"{n} {t}" for t, n in types.most_common())
