"""mlx-lm's quantized model folders, exported as they are.

`mlx_lm.convert -q` writes a Hugging Face folder whose config.json has
`"quantization": {"group_size": G, "bits": B, "mode": "affine", <layer>: ...}`
and whose quantized layers hold `weight` (uint32, B-bit values packed along
the input), `scales` and `biases` ([N, K/G] each): MLX's affine layout, the
one our int4/int8 programs store (llm/export/quantize.py). Export keeps those
tensors as they are (no requantization: the packed bytes in the .pte are the
folder's), reads the other tensors of the folder into the model, one tensor
at a time (lowering/weight_files.py), and ties the output layer to the
quantized embedding where the folder has no lm_head of its own.

A per-layer entry in "quantization" gives that layer its own group size and
bits (mlx-lm's mixed recipes), `false` leaves it in full precision. Mode
"mxfp4" (`mlx_lm.convert --q-mode mxfp4`) layers have uint8 scales and no
biases, kept as they are too. Widths, group sizes and modes our ops do not
have (custom_kernel_ops/quantized.py) and mlx-lm's own expert layout
(`switch_mlp`) are refused by name.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ...custom_kernel_ops.quantized import BITS, GROUP_SIZES, MODES, QuantFormat
from ...lowering.weight_files import keep
from .module_globals import replaced
from .quantize import QuantizedLinear, QuantizedTable, embedding_scale
from .streamed_load import release_mapped_pages


def mlx_quantization(config: dict) -> dict | None:
    """config.json's mlx-lm quantization entry, or None for a folder of full-precision weights."""
    q = config.get("quantization")
    return q if isinstance(q, dict) else None


def describe(quantization: dict) -> str:
    """The program contract's quantization string for an mlx-lm folder."""
    differ = [v for v in quantization.values() if isinstance(v, dict) or v is False]  # own bits, or none
    mixed = f" ({len(differ)} layers differ)" if differ else ""
    kind = quantization.get("mode", "affine")
    what = f"int{quantization['bits']} group {quantization['group_size']}" if kind == "affine" else kind
    return f"mlx-lm {what}{mixed}"


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built within get their parameters on the meta device (no
    memory, no initialization) and keep real buffers (rotary frequencies)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with replaced(torch.nn.Module, "register_parameter", on_meta):
        yield


def tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    names = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            names.update({k: path for k in f.keys()})
    return names


def _layer_mode(quantization: dict, name: str) -> QuantFormat:
    """The format of a quantized layer, checked against what our ops run."""
    own = quantization.get(name)
    mode = own if isinstance(own, dict) else quantization
    kind, group, bits = mode.get("mode", "affine"), mode.get("group_size"), mode.get("bits")
    if kind not in MODES:
        raise NotImplementedError(f"{name}: mlx-lm's {kind!r} quantization is not read yet "
                                  f"({', '.join(MODES)} only)")
    if bits not in BITS or group not in GROUP_SIZES:
        raise NotImplementedError(f"{name}: {bits}-bit weights in groups of {group}; export runs "
                                  f"{'/'.join(map(str, BITS))} bits in groups of {'/'.join(map(str, GROUP_SIZES))}")
    return QuantFormat(bits, group, kind)


def meta_model(model_dir: Path, dtype: torch.dtype):
    """(config, model) of a quantized folder: its config without the
    quantization entry, the model's parameters on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key in ("quantization", "quantization_config"):
        if hasattr(config, key):
            delattr(config, key)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return config, model


def _params(read, name: str, dtype: torch.dtype, affine: bool) -> tuple:
    """A layer's (scales, biases): affine ones bfloat16 as stored under a
    float32 or bfloat16 program (our CPU kernel reads them so: no rounding,
    and half the bytes of float32), else in `dtype`; E8M0 exponents as they
    are, no biases."""
    if not affine:
        return read(f"{name}.scales"), None
    scales, biases = read(f"{name}.scales"), read(f"{name}.biases")
    keep_bf16 = scales.dtype == biases.dtype == torch.bfloat16 and dtype in (torch.float32, torch.bfloat16)
    return (scales, biases) if keep_bf16 else (keep(scales.to(dtype)), keep(biases.to(dtype)))


def tensor_reader(model_dir: Path, files: dict[str, Path]):
    """read(name, dtype=None): one tensor of the folder, kept in a file while export runs."""
    from safetensors import safe_open

    def read(name: str, to=None) -> torch.Tensor:
        with safe_open(files[name], "pt") as f:
            tensor = f.get_tensor(name)
        tensor = keep(tensor if to is None else tensor.to(to))
        release_mapped_pages(model_dir)
        return tensor

    return read


def read_other_tensors(model, model_dir: Path, files: dict[str, Path], read, taken: set[str], dtype) -> None:
    """Every tensor of the folder not in `taken` into the model's parameter of
    its name; a tensor the model has no parameter for is an error."""
    own = dict(model.named_parameters(remove_duplicate=False))
    unexpected = sorted(k for k in files if k not in taken and k not in own)
    if unexpected:
        raise ValueError(f"{model_dir}: tensors the model in its config.json does not have: {', '.join(unexpected[:8])}")
    for name in files:
        if name in own and name not in taken:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(read(name, dtype), requires_grad=False))


def check_none_missing(model, model_dir: Path) -> None:
    missing = sorted(n for n, p in model.named_parameters() if p.device.type == "meta")
    if missing:
        raise ValueError(f"{model_dir}: tensors missing from the folder: {', '.join(missing[:8])}")


def load_mlx_quantized(model_dir: str | Path, dtype: torch.dtype):
    """The model of an mlx-lm quantized folder, its quantized layers as
    QuantizedTable/QuantizedLinear modules holding the folder's tensors."""
    model_dir = Path(model_dir)
    quantization = mlx_quantization(json.loads((model_dir / "config.json").read_text()))
    config, model = meta_model(model_dir, dtype)
    files = tensor_files(model_dir)
    if any(".switch_mlp." in k for k in files):
        raise NotImplementedError(f"{model_dir}: mlx-lm's expert layout (switch_mlp) is not read yet")
    read = tensor_reader(model_dir, files)

    embed = model.get_input_embeddings()
    embed_name = _name_of(model, embed)
    head = model.get_output_embeddings()
    head_name = None if head is None else _name_of(model, head)
    tables: dict[str, QuantizedTable] = {}
    for name in sorted(k[: -len(".scales")] for k in files if k.endswith(".scales")):
        fmt = _layer_mode(quantization, name)
        module = model.get_submodule(name)
        width = getattr(module, "in_features", None) or getattr(module, "embedding_dim", None)
        packed = read(f"{name}.weight")
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or \
                packed.shape[-1] * 32 != width * fmt.bits or packed.dtype not in (torch.uint32, torch.int32):
            raise ValueError(f"{model_dir}: {name} is not a {fmt.bits}-bit quantized linear layer or embedding of "
                             f"width {width} (its packed weight is {packed.dtype} {list(packed.shape)})")
        scale = embedding_scale(name, module) if module is embed else None
        affine = fmt.mode == "affine"  # else E8M0 exponents (uint8) as they are, and no biases
        held = (packed.view(torch.int32), *_params(read, name, dtype, affine))
        tables[name] = table = QuantizedTable(None, fmt, scale, tables=held, dtype=dtype)
        bias = f"{name}.bias"
        new = table if module is embed else QuantizedLinear(table, read(bias, dtype) if bias in files else None)
        replace_module(model, name, new)

    taken = {f"{n}.{t}" for n in tables for t in ("weight", "scales", "biases", "bias")}
    read_other_tensors(model, model_dir, files, read, taken, dtype)
    if head_name is not None and getattr(config, "tie_word_embeddings", False) and f"{head_name}.weight" not in files:
        if embed_name in tables:  # mlx-lm's tied output layer: the quantized embedding as a linear layer
            replace_module(model, head_name, QuantizedLinear(tables[embed_name], None))
        else:
            model.tie_weights()
    check_none_missing(model, model_dir)
    return model


def _name_of(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def replace_module(model, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
