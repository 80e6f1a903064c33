"""What `export_llm` checks before and around its work, so that a careless
path or an incomplete model folder is an error naming the cause, and no
export, failed or not, loses a file.

- `check_output_path`: before any work, refuses an output that is a folder,
  in a folder that does not exist or cannot be written, or that is one of the
  model folder's own files (its weights, config or tokenizer).
- `write_atomically`: the program goes to a temporary file beside the target,
  renamed over it only once completely written. A process that has the old
  file loaded (memory-mapped) keeps its mapping; a failed write (a full disk)
  leaves the old file as it was and no partial file.
- `check_architecture`: a causal LM transformers knows, whose layers attend
  (what export does not build yet is an error naming it).
- `check_config` / `load_weights`: config.json parses and is consistent; the
  weights load from safetensors only (never pickle-based pytorch_model.bin),
  every tensor the model has is in them and every tensor in them is used.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

# Bound so that a test can simulate a failing disk (a full one, say).
_write = os.write


def check_output_path(model_dir: str | Path, output_path: str | Path) -> Path:
    """The output path, checked before any work (see the module's docstring)."""
    out = Path(output_path)
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"output {out} is a folder: give a file name (e.g. {out / 'model.pte'})")
    parent = out.parent
    if not parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"the output's folder {parent} does not exist (or is not a folder)")
    if out.exists():
        model_dir = Path(model_dir)
        for f in model_dir.iterdir() if model_dir.is_dir() else []:
            # samefile: through symlinks (Hugging Face's cache) and hard links
            if f.suffix != ".pte" and f.is_file() and os.path.samefile(f, out):
                raise ValueError(f"output {out} is {f.name} of the model folder {model_dir}: exporting would "
                                 f"overwrite its input; write the .pte elsewhere (e.g. {model_dir / 'model.pte'})")
    # A real probe, not os.access: it sees read-only mounts, ACLs and quotas.
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".probe")
    except OSError as e:
        raise PermissionError(e.errno, f"cannot write in the output's folder {parent}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    return out


class _RawFile:
    """The write() that ExecuTorch's `write_to_file` needs, straight to a file
    descriptor through `_write` (short writes retried)."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            view = view[_write(self.fd, view[:1 << 24]):]
        return total


def write_atomically(path: Path, write: Callable[[_RawFile], None]) -> None:
    """Calls `write(file)` on a temporary file in `path`'s folder, then renames
    it over `path` (atomic on POSIX). On any failure the temporary file is
    removed and `path` is untouched. (A writer, not bytes: the program is
    written a segment at a time, never held whole in memory.)"""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            mode = path.stat().st_mode & 0o777  # a re-export keeps the file's permissions
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # as a plain open() would create it
        os.fchmod(fd, mode)
        write(_RawFile(fd))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"writing {path} failed ({e.strerror or e}); the file is unchanged") from e
        raise


def read_config_json(model_dir: str | Path) -> None:
    """config.json must parse: an error naming the file, not a bare JSONDecodeError."""
    path = Path(model_dir) / "config.json"
    if path.is_file():
        try:
            json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def with_standard_names(config: dict) -> dict:
    """config.json with transformers' standard names filled in where the
    family uses its own (GPT-2's n_embd, n_head, n_layer, n_positions) or
    derives one (LongCat-Flash's num_hidden_layers: two per num_layers)."""
    from transformers import CONFIG_MAPPING

    try:
        family = CONFIG_MAPPING[config.get("model_type")]
    except KeyError:  # not a transformers family: check_architecture says so
        return config
    named = {name: config[alias] for name, alias in (family.attribute_map or {}).items() if alias in config}
    if "num_hidden_layers" not in config and isinstance(getattr(family, "num_hidden_layers", None), property):
        try:
            named["num_hidden_layers"] = family.from_dict(config).num_hidden_layers
        except Exception:  # a config its own class refuses: the checks name what is missing
            pass
    return {**named, **config}


# Layer kinds with a key/value cache, and those that keep a state instead
# (llm/export/state_cache.py) or nothing (a layer of MLP or experts only).
# (chunks: Llama 4's; hybrid: attention beside a state in one layer, Falcon-H1's;
# indexed: DeepSeek-V3.2's sparse attention, its keys picked by a scorer with a cache of its own)
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "hybrid", "indexed_attention"}
STATE_LAYERS = {"linear_attention", "conv"}
CACHELESS_LAYERS = {"mlp", "moe"}


def check_architecture(config: dict, model_dir: str | Path) -> None:
    """Any decoder-only causal LM of transformers whose layers attend with a
    key/value cache; what export does not build yet (state layers) is an
    error naming it. Mixture-of-experts layers are checked once
    the model is built (llm/export/experts.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model_dir) / "config.json"
    arch = config.get("model_type")
    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{path}: model_type {arch!r} is not a causal language model transformers knows "
                         "(AutoModelForCausalLM)")
    kinds = layer_kinds(config)
    others = sorted(set(kinds) - ATTENTION_LAYERS - STATE_LAYERS - CACHELESS_LAYERS)
    if others or (attends(config) and "num_attention_heads" not in with_standard_names(config)):
        kinds = ", ".join(others) or "non-attention"
        raise NotImplementedError(f"{path}: {arch} has {kinds} layers, which export does not build yet")


def layer_kinds(config: dict) -> list[str]:
    """Each layer's kind, from config.json (`layer_types`, or Nemotron-H's
    `layers_block_type`); [] when the config does not list them."""
    kinds = config.get("layer_types") or config.get("layers_block_type") or []
    return list(kinds) if isinstance(kinds, list) and all(isinstance(k, str) for k in kinds) else []


def attends(config: dict) -> bool:
    """Whether some layer attends (keeps keys and values): the layer kinds
    say, else a config with a state size and no attention heads is all state
    layers (Mamba-1's and Mamba-2's; Mamba-2's `num_heads` are its scan's)."""
    kinds = layer_kinds(config)
    if kinds:
        return bool(set(kinds) & ATTENTION_LAYERS)
    return "num_attention_heads" in config or "state_size" not in config


def _positive_int(config: dict, key: str, path: Path, required: bool = True) -> int | None:
    value = config.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def check_config(config: dict, model_dir: str | Path) -> None:
    """The sizes export relies on, consistent (a clean error, not a shape
    error deep inside transformers or torch.export)."""
    path = Path(model_dir) / "config.json"
    vocab = _positive_int(config, "vocab_size", path)
    hidden = _positive_int(config, "hidden_size", path)
    if not attends(config):
        return  # state layers only: no attention sizes to check
    kinds = layer_kinds(config)
    heads = _positive_int(config, "num_attention_heads", path)
    kv_heads = _positive_int(config, "num_key_value_heads", path, required=False) or heads
    _positive_int(config, "num_hidden_layers", path, required=not kinds)
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"{path}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    _positive_int(config, "head_dim", path, required=False)
    if heads % kv_heads:
        raise ValueError(f"{path}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
    for key in ("pad_token_id", "bos_token_id"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
            raise ValueError(f"{path}: {key} {value!r} is not a token id in [0, {vocab}) (vocab_size)")


def check_context(config: dict, model_dir: str | Path, max_context: int, allow_longer_context: bool,
                  dtype_bytes: int) -> None:
    """max_context within the model's trained positions (unless allowed),
    and its KV cache within this machine's memory budget."""
    trained = config.get("max_position_embeddings")
    if isinstance(trained, int) and max_context > trained and not allow_longer_context:
        raise ValueError(f"max_context {max_context} exceeds the model's max_position_embeddings {trained} "
                         f"({Path(model_dir) / 'config.json'}): positions beyond it were never trained; pass "
                         f"allow_longer_context=True (--allow-longer-context) to export anyway")
    from ... import memory_budget

    if not attends(config):
        return  # no KV cache
    layer_types = layer_kinds(config) or ["full_attention"] * config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    window = config.get("sliding_window")
    positions = sum(min(window, max_context) if t == "sliding_attention" and window else max_context
                    for t in layer_types if t in ATTENTION_LAYERS)
    cache = 2 * positions * kv_heads * head_dim * dtype_bytes  # keys and values, in the export dtype
    budget = memory_budget()
    if cache > budget:
        raise ValueError(f"the KV cache at max_context {max_context} takes {_size(cache)}, over this machine's "
                         f"memory budget of {_size(budget)} (EMLX_MEMORY_BUDGET): the program would not load; "
                         f"export with a smaller max_context")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _check_safetensors_headers(model_dir: Path) -> None:
    """A weights file that transformers would read (model.safetensors, or the
    shards its index names) whose header does not parse or does not fit the
    file (a cut-off download) is refused in a second, before transformers
    builds the model."""
    from safetensors import SafetensorError, safe_open

    try:
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        names = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = ["model.safetensors"]  # no usable index: transformers says what is wrong
    for name in names:
        path = model_dir / name
        if path.is_file():
            try:
                with safe_open(path, "pt"):
                    pass
            except SafetensorError as e:
                raise ValueError(f"cannot load the weights of {model_dir}: corrupt safetensors ({e})") from e


def load_weights(model_dir: str | Path, dtype):
    """The model with every weight from the folder's safetensors, or an error
    naming the missing, unexpected or mis-shaped tensors."""
    model_dir = Path(model_dir)
    _check_safetensors_headers(model_dir)
    from .mlx_folders import load_mlx_quantized, mlx_quantization
    from .mxfp4_folders import is_mxfp4_folder, load_mxfp4_folder

    config = json.loads((model_dir / "config.json").read_text())
    if mlx_quantization(config) is not None:
        return load_mlx_quantized(model_dir, dtype)
    if is_mxfp4_folder(config):
        return load_mxfp4_folder(model_dir, dtype)
    from transformers import AutoModelForCausalLM

    from .streamed_load import streamed_load
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        # use_safetensors=True: never pytorch_model.bin (pickle), even when
        # a safetensors file of another name is beside it.
        # ignore_mismatched_sizes=True: mis-shaped tensors are listed in
        # `info` (refused below, by name) instead of a bare RuntimeError.
        with streamed_load(model_dir):  # into files, one tensor at a time, while export's weight files are active
            model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True,
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
    except StrictDataclassError as e:  # transformers' own config validation
        raise ValueError(f"{model_dir / 'config.json'} is inconsistent: {' '.join(str(e).split())}") from e
    except SafetensorError as e:
        raise ValueError(f"cannot load the weights of {model_dir}: corrupt safetensors ({e})") from e
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot load the weights of {model_dir}: {str(e).strip().splitlines()[0]}") from e
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        # (mismatched entries are (name, checkpoint shape, model shape))
        keys = sorted(k if isinstance(k, str) else f"{k[0]} {list(k[1])} (the model's is {list(k[2])})"
                      if len(k) == 3 else str(k) for k in info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            problems.append(f"{kind.replace('_keys', '')} tensor(s): {shown}")
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"])))
    if problems:
        raise ValueError(f"the weights in {model_dir} do not match the model in its config.json ("
                         + "; ".join(problems) + "): refusing to export a model with missing or unused weights")
    return model.eval()
