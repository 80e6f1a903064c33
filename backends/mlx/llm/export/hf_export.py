"""Export a Hugging Face decoder-only model folder to a `.pte` for our backend.

The program has one method, `forward`, that prefills (a whole prompt chunk
in one call, dynamic length) and decodes (one token) with the KV cache kept
inside the MLX delegate. Its inputs and metadata are the LLM program
contract (llm/program_contract.py): `input_ids` int64 [1, S] (S in
[1, max_chunk]) and `cache_position` int64 [S] (positions start, start+1,
...), then, sampling programs only, every sampler input of the table
(serialization/sampler_params.py, docs/sampling.md) in its order, each []
except the tables: history (int64 [1, history_size], the token ids the
penalties count, -1 pads), logit_bias_ids (int64 [1, logit_bias_size], -1
pads) and logit_bias_values (float32 [1, logit_bias_size]).

A sampling program (the default) returns the next token id, int64 [1] (and,
exported with `logprobs=True`, its float32 [1] log-probability); it also
verifies draft tokens fed after the last one, a history row for each
(speculative decoding, llm/export/speculative.py), and then returns the tokens it
accepts and the next one, -1 padded. A
`sampling=False` program returns the last position's logits [1, 1, vocab]
(what ExecuTorch's own TextLLMRunner expects). Metadata are constant methods
with ExecuTorch's LLM-runner names plus ours.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from ...lowering.weight_files import weight_files
from ...progress import CountingWriter, counter
from ...serialization.sampler_params import ROW_PARAMS
from .attention import attend_written_prefix
from .batched import BatchedLM, SampledRows, batched_example
from .complex_rotary import real_rotary
from .experts import check_experts_routed, route_experts
from .export_checks import check_architecture, with_standard_names
from .fused_projections import fuse_shared_input_projections
from .gguf_files import describe as gguf_types, gguf_config, is_gguf, load_gguf
from .local_attention import position_local_attention
from .mlx_folders import describe as mlx_types, mlx_quantization
from .mxfp4_folders import is_mxfp4_folder
from .options import DTYPES, MAX_DRAFT_TOKENS, ExportOptions
from .quantize import quantize_model
from .ring_cache import ring_chunk, use_rings
from .. import program_contract
from ...serialization.sampler_params import mask_words
from ..sampler_inputs import SAMPLER_INPUTS, TOKEN_MASK
from .sampling import llm_forward_signature, sampler_examples
from .speculative import verify
from .state_cache import StateCachedModel, find_state_layers, one_token_cache

assert SAMPLER_INPUTS[-1] == TOKEN_MASK  # SampledLM's one optional input (--no-grammar), last



def read_config(model_dir: str | Path) -> dict:
    """config.json of a model folder, checked for what export needs."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: a Hugging Face model folder has config.json")
    config = with_standard_names(json.loads(config_path.read_text()))
    check_architecture(config, model_dir)
    if not list(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"no weights in {model_dir}: expected *.safetensors files")
    return config


def refuse_ops_outside(partitioner, model_dir: str | Path, model_path: str = "wrapper.model.") -> None:
    """An LLM runs whole in the delegate: an op with no MLX lowering would
    run on ExecuTorch's portable kernels (with the cache copied to the host
    each step), so it is an error naming the op and its module instead.
    Size bookkeeping may stay outside. `model_path`: where the Hugging Face
    model sits in the exported module (a prefix of its modules' paths)."""
    from ...partitioner import SIZE_OUTSIDE

    def module(op: str, why: str) -> str:
        # the Hugging Face model's own path, without our wrappers around it
        return partitioner.outside_modules[op, why].rsplit(model_path, 1)[-1] or "the model"

    missing = [f"{op} in {module(op, why)} ({why})" for op, why in partitioner.outside if why != SIZE_OUTSIDE]
    if missing:
        raise NotImplementedError(f"{model_dir}: export cannot lower every op of this model to MLX: "
                                  + "; ".join(missing))


def _set_cached_kv_heads(config) -> None:
    """transformers' static cache takes its head count from
    num_key_value_heads, which Falcon's config does not have: its layers
    cache all heads (new decoder architecture), one (multi-query) or
    num_kv_heads."""
    if config.model_type == "falcon":
        config.num_key_value_heads = (config.num_attention_heads if config.new_decoder_architecture
                                      else 1 if config.multi_query else config.num_kv_heads)


def _fit_cache_widths(written, wrapper: torch.nn.Module, cache) -> None:
    """Sizes each layer's static cache (transformers sizes every layer from
    the head count and head_dim) to what its attention writes: multi-head
    latent attention (DeepSeek-V2/V3 and their kind) caches one compressed
    key/value latent and one rotary key shared by the heads per position,
    MiMo-V2-Flash's values are narrower than its keys and its sliding layers
    have twice the key/value heads of its full ones. `written`: transformers'
    own cache after one token (one_token_cache)."""
    shapes = {i: (layer.keys.shape, layer.values.shape) for i, layer in enumerate(getattr(written, "layers", ()))
              if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4}
    for i, layer in enumerate(cache.layers):
        if i not in shapes or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            continue
        key, value = shapes[i]
        if (key[1], key[3], value[1], value[3]) == (*layer.keys.shape[1::2], *layer.values.shape[1::2]):
            continue
        layer.lazy_initialization(layer.keys.new_empty(1, key[1], 0, key[3]),
                                  layer.values.new_empty(1, value[1], 0, value[3]))
        wrapper.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        wrapper.register_buffer(f"value_cache_{i}", layer.values, persistent=False)


def _indexer_caches(written, wrapper: torch.nn.Module, cache) -> list[int]:
    """Allocates the indexer key cache of each layer with indexed attention
    (DeepSeek-V3.2's sparse attention and its kind: a small scorer picks the
    keys each query attends to, from keys of its own kept per position) as
    buffers beside the key/value cache; the layers that have one."""
    indexed = []
    for i, layer in enumerate(cache.layers):
        kept = written.layers[i] if hasattr(written, "layers") else None
        keys = getattr(kept, "indexer_keys", None)
        if not isinstance(keys, torch.Tensor):
            continue
        if getattr(kept, "indexer_position_ids", None) is not None or not hasattr(layer, "update_indexer"):
            raise NotImplementedError(f"layer {i} picks its keys with an indexer that keeps positions of its own "
                                      "(blocks of compressed keys, Qwen4-exp's), which export does not build yet")
        layer.lazy_initialization_indexer(torch.zeros(1, 0, keys.shape[-1], dtype=layer.keys.dtype))
        wrapper.register_buffer(f"indexer_keys_{i}", layer.indexer_keys, persistent=False)
        wrapper.register_buffer(f"indexer_length_{i}", layer.indexer_cumulative_length, persistent=False)
        indexed.append(i)
    return indexed


class CachedLM(torch.nn.Module):
    """(input_ids [1, S], cache_position [S]) -> logits of the last position [1, 1, V],
    with a static KV cache registered as buffers (transformers' exportable
    cache: the writes are `index_put` on them)."""

    def __init__(self, model, max_context: int, ring_chunk: int | None = None, snapshots: int = 1):
        """`ring_chunk`: put the sliding-window layers on ring buffers for
        calls of at most that many tokens (llm/export/ring_cache.py). `snapshots`:
        the states each state layer keeps (llm/export/state_cache.py)."""
        super().__init__()
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        params = inspect.signature(model.forward).parameters
        if "past_key_values" not in params and "cache_params" not in params:
            raise NotImplementedError(f"{type(model).__name__} takes no cache (its forward has no past_key_values): "
                                      "each token would recompute the whole text, which export does not build")
        # the program always runs through its cache (MPT's configs say no)
        model.config.get_text_config().use_cache = model.generation_config.use_cache = True
        model.generation_config.cache_implementation = "static"
        _set_cached_kv_heads(model.config)
        written = one_token_cache(model)  # what each layer caches, as the family's code writes it
        states = find_state_layers(model, written)
        if states:
            self.wrapper = StateCachedModel(model, max_context, states, snapshots)
            ring_chunk = None
        else:
            self.wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_context).model
        self.states = self.wrapper.states if states else None
        self.cache = getattr(self.wrapper, "static_cache", None) or self.wrapper.cache
        # the model's name for its cache (Mamba's is cache_params)
        self.cache_argument = "past_key_values" if "past_key_values" in params else "cache_params"
        _fit_cache_widths(written, self.wrapper, self.cache)
        self.indexed = _indexer_caches(written, self.wrapper, self.cache)
        self.rings = use_rings(model, self.wrapper, self.cache, ring_chunk) if ring_chunk else {}
        self.positioned = position_local_attention(model)
        # None: the family's code builds its masks from the positions (see `trace`)
        self.full_mask: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor,
                rows: int | torch.SymInt = 1) -> torch.Tensor:
        """The logits of the last `rows` positions, [1, rows, V]."""
        seq = input_ids.shape[1]
        if self.states is not None:
            self.states.begin(cache_position, seq)
        for i, layer in enumerate(self.cache.layers):
            if self.states is not None and not self.states.keeps_keys(i):
                continue
            # Reached through the module, the cache tensors are the buffers
            # export traces (non-strict export swaps module attributes only;
            # through the cache object they would be lifted again as constants).
            layer.keys = getattr(self.wrapper, f"key_cache_{i}")
            layer.values = getattr(self.wrapper, f"value_cache_{i}")
            layer.cumulative_length = getattr(self.wrapper, f"cumulative_length_{i}")
            layer.cumulative_length.copy_(cache_position[0])
            if i in self.indexed:
                layer.indexer_keys = getattr(self.wrapper, f"indexer_keys_{i}")
                layer.indexer_cumulative_length = getattr(self.wrapper, f"indexer_length_{i}")
                layer.indexer_cumulative_length.copy_(cache_position[0])
            if i in self.rings:
                layer.positions = getattr(self.wrapper, f"ring_positions_{i}")
                layer.query_positions = cache_position
        for module in self.positioned:
            module._mlx_positions = cache_position
        # no [S, V] logits on prefill: the last `rows` positions only (by index,
        # which transformers takes for a count that is a size of an input)
        keep = 1 if isinstance(rows, int) and rows == 1 else torch.arange(seq - rows, seq)
        with (self.states.kernels(self.wrapper.model) if self.states is not None else contextlib.nullcontext(),
              real_rotary(self.wrapper.model)):
            # positions given, as generate() gives them: some families (Bamba) count from 0 when left out
            out = self.wrapper.model(input_ids=input_ids, attention_mask=self.full_mask,
                                     position_ids=cache_position[None], use_cache=True, logits_to_keep=keep,
                                     **{self.cache_argument: self.cache})
        return out.logits


class SampledLM(torch.nn.Module):
    """CachedLM with the sampler and draft verification (llm/export/speculative.py),
    taking every sampler input by position (the program contract's order)
    for export; the token mask comes last and may be left out (a program
    without a grammar input)."""

    def __init__(self, lm: CachedLM, logprobs: bool, top_logprobs: int = 0):
        super().__init__()
        self.lm = lm
        self.logprobs, self.top_logprobs = logprobs, top_logprobs

    def forward(self, input_ids, cache_position, *sampler):
        return verify(self.lm, input_ids, cache_position, dict(zip(SAMPLER_INPUTS, sampler)), self.logprobs,
                      self.top_logprobs)

    forward.__signature__ = llm_forward_signature()


def trace(module: torch.nn.Module, example: tuple, dynamic: dict, model_dir: str | Path):
    """torch.export of the program; a model whose code branches on, or sizes
    a tensor by, a value it computes at run time (its cache's length, the
    experts a batch hits: what no static graph has; torch names such values
    u0, u1, ...) is refused naming the line, as is one whose code takes
    another path for some call lengths."""
    from torch._dynamo.exc import UserError, UserErrorType
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    lm = next((m for m in module.modules() if isinstance(m, CachedLM)), None)
    try:
        with torch.no_grad():
            program = torch.export.export(module.eval(), example, dynamic_shapes=dynamic, strict=False)
        read = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)  # a length read as a number
        if lm is not None and lm.full_mask is None and any(n.target in read for n in program.graph.nodes):
            return _with_full_mask(lm, module, example, dynamic, model_dir)
        return program
    except UserError as e:
        if e.error_type != UserErrorType.CONSTRAINT_VIOLATION:
            raise
        guards = "; ".join(line.strip(" -") for line in str(e).splitlines()[1:] if "guard" in line)
        raise NotImplementedError(f"{model_dir}: the model's code takes another path for some call lengths, which "
                                  f"one program for every length cannot hold ({guards})") from e
    except (GuardOnDataDependentSymNode, RuntimeError, ValueError) as e:
        if not isinstance(e, GuardOnDataDependentSymNode) and not re.search(r"\bu\d+\b", str(e)):
            raise
        if lm is not None and lm.full_mask is None:
            return _with_full_mask(lm, module, example, dynamic, model_dir)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/transformers/models/" in f.filename]
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        raise NotImplementedError(f"{model_dir}: the model's code depends on a value it computes at run time"
                                  f"{where}, which export cannot trace into a static graph") from e


def _with_full_mask(lm: CachedLM, module: torch.nn.Module, example: tuple, dynamic: dict, model_dir):
    """`trace` again with a mask of ones over the whole cache: some families
    (OPT, BioGPT) size their masks and positions by the cache's length when
    given no mask, which the mask's static size replaces (no padding: the
    same attention)."""
    lm.full_mask = torch.ones(1, max(layer.max_cache_len for layer in lm.cache.layers
                                     if hasattr(layer, "max_cache_len")), dtype=torch.int64)
    return trace(module, example, dynamic, model_dir)


def metadata(config: dict, max_context: int, max_chunk: int, sampling: bool, quantization: str,
             logprobs: bool = False, token_mask: bool = True, max_draft_tokens: int = 0,
             cache_rewind: int | None = None, weights_file: str | None = None, top_logprobs: int = 0) -> dict:
    """Constant methods: ExecuTorch's LLM-runner names, then ours (emlx_*)."""
    names = SAMPLER_INPUTS if token_mask else tuple(n for n in SAMPLER_INPUTS if n != TOKEN_MASK)
    return program_contract.llm_metadata(config, max_context, max_chunk, sampling, quantization, logprobs, names,
                                         max_draft_tokens, cache_rewind, weights_file, top_logprobs)


def quantization_label(config: dict, model_dir, fmt, embedded: bool, activations: str) -> str:
    """The program's emlx_quantization metadata: how its weights are stored."""
    label = "none" if fmt is None else f"{fmt}" + (" +embedding" if embedded else "") + (
        ", bf16 scales" if fmt.bf16_params else "")
    if mlx_quantization(config) is not None:  # an mlx-lm folder: its quantized weights as they are
        label = mlx_types(mlx_quantization(config))
    if is_mxfp4_folder(config):  # gpt-oss: its MXFP4 experts as they are, the rest as asked
        label = "mxfp4 experts" + ("" if fmt is None else f", then {label}")
    if is_gguf(model_dir):
        label = gguf_types(model_dir) + ("" if fmt is None else f", then {label}")
    if label != "none" and activations == "float":
        label += ", float activations"
    return label


def write_data_file(program, path: Path) -> None:
    """The program's external data file (ExecuTorch writes it as TAG.ptd into
    a folder) as `path`, replaced whole: written into a temporary folder
    beside it, then renamed over it."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        program.write_tensor_data_to_file(str(tmp))
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_llm(model_dir: str | Path, output_path: str | Path, options: ExportOptions | None = None, *,
               progress: Callable[[str], None] | None = print) -> Path:
    """Exports the model folder (or GGUF file) to `output_path` (a .pte) as
    `options` say (llm/export/options.py; default ExportOptions()); returns
    its path. `progress` gets a line per stage (None: quiet).

    Checked before any work (llm/export/export_checks.py): the output path (not a
    folder, a writable folder, not one of the model folder's files) and the
    config; the weights load from safetensors only, all of them used, none
    missing. The file is written atomically: a failed export leaves an
    existing `output_path` unchanged, and a process that has it loaded keeps
    running on the old program."""
    from .export_checks import (check_config, check_context, check_output_path, load_weights, read_config_json,
                                write_atomically)

    if is_gguf(model_dir):  # llama.cpp's file: config from its metadata (llm/export/gguf_files.py)
        config = gguf_config(model_dir)
    else:
        read_config_json(model_dir)
        config = read_config(model_dir)
    check_config(config, model_dir)
    o = options or ExportOptions()
    check_context(config, model_dir, o.max_context, o.allow_longer_context, DTYPES[o.dtype].itemsize)
    fmt = o.quant_format
    max_context, sampling, max_batch, max_draft_tokens = o.max_context, o.sampling, o.max_batch, o.drafts
    logprobs, top_logprobs = o.with_logprobs, o.top_logprobs
    output_path = check_output_path(model_dir, output_path)
    if o.external_weights:
        if output_path.suffix == ".ptd":
            raise ValueError(f"output {output_path} would be its own weights file: name the program *.pte")
        check_output_path(model_dir, output_path.with_suffix(".ptd"))
    if mlx_quantization(config) is not None and (o.quantize is not None or o.quantize_embedding):
        raise ValueError(f"{model_dir} is already quantized ({mlx_types(mlx_quantization(config))}): export "
                         "keeps its weights as they are; leave out quantize")
    activations = o.activations
    if activations is None:  # an mlx-lm folder computes as mlx-lm does; the rest as llama.cpp
        activations = "float" if mlx_quantization(config) is not None else "int8"
    say = progress or (lambda _: None)
    started = time.perf_counter()

    def stage(text: str) -> None:
        say(f"[{time.perf_counter() - started:6.1f} s] {text}")

    # The weights wait in files beside the output, loaded and quantized one
    # tensor at a time, until the program is written (lowering/weight_files.py).
    with weight_files(output_path.parent):
        stage(f"loading {config['model_type']} from {model_dir} ({o.dtype})")
        model = (load_gguf(model_dir, DTYPES[o.dtype], stage) if is_gguf(model_dir)
                 else load_weights(model_dir, DTYPES[o.dtype]))
        experts = route_experts(model)
        check_experts_routed(model, experts)
        if experts:
            stage(f"{len(experts)} mixture-of-experts layers")
        embedded = False  # the input embedding quantized by --quantize
        if fmt is not None:
            embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            embed_name = next((n for n, m in model.named_modules() if m is embed), None)
            del embed  # (its weight is freed once quantized)
            layers = quantize_model(model, fmt, embedding=o.quantize_embedding)
            embedded = embed_name in layers
            why = "--no-quantize-embedding" if o.quantize_embedding is False else "not a layer we can quantize"
            stage(f"quantized {len(layers)} layers to {fmt}" + ("" if embedded or embed_name is None else
                  f" (the input embedding {embed_name} kept as it is: {why})"))
        sampler = sampler_examples(1, seeded=True, per_row=False, params=ROW_PARAMS, history_size=o.history_size,
                                   logit_bias_size=o.logit_bias_size,
                                   mask_words=mask_words(int(config["vocab_size"])) if o.token_mask else 0)
        model_path, slots, lm = "wrapper.model.", max_context, None  # (the module's path to the model; cache slots)
        if max_batch > 1:
            max_chunk, rewind, model_path, slots = max_context - 1, None, "lm.model.", max_context + 1
            module = SampledRows(BatchedLM(model, max_context, max_batch), logprobs, top_logprobs)
            example, dynamic = batched_example(sampler, max_batch, max_chunk)
            stage(f"up to {max_batch} sequences per call, each in its own cache row")
        else:
            # sliding-window layers on rings take calls of at most a window (llm/export/ring_cache.py)
            chunk = ring_chunk(model, max_context, MAX_DRAFT_TOKENS + 1)
            max_chunk = chunk or max_context - 1
            lm = CachedLM(model, max_context, chunk, snapshots=max_draft_tokens + 1)
            rewind = chunk  # how far back a call may start, when not every position stays (the program contract)
            if lm.states is not None:  # a call may start up to max_draft_tokens before the end (llm/export/state_cache.py)
                chunk, max_chunk, rewind = None, max_context - 1, max_draft_tokens
                stage(f"{len(lm.states.states)} state layers, states kept after each of the last "
                      f"{max_draft_tokens + 1} positions")
            if chunk:
                ring = next(iter(lm.rings.values())).max_cache_len
                stage(f"{len(lm.rings)} sliding-window layers on ring buffers of {ring} slots, calls of up to "
                      f"{chunk} tokens")
            seq = torch.export.Dim("seq", min=1, max=max_chunk)
            example = (torch.tensor([[0, 0, 0]], dtype=torch.int64), torch.arange(3))
            dynamic = {program_contract.LLM_INPUTS[0]: {1: seq}, program_contract.LLM_INPUTS[1]: {0: seq}}
            if sampling:
                module = SampledLM(lm, logprobs, top_logprobs)
                dynamic.update({name: None for name in sampler})
                if max_draft_tokens:  # the history's rows are the rows sampled: 1 + the drafts
                    sampler["history"] = sampler["history"].expand(2, -1).contiguous()
                    dynamic["history"] = {0: torch.export.Dim("rows", min=1, max=max_draft_tokens + 1)}
                example += tuple(sampler.values())
            else:
                module = lm
        stage("exporting (torch.export)")
        # the export stack is imported after every check (weights included): a refused export is quick
        from ...lowering.unused_constants import drop_unused_constants
        from ...lowering.whole_program import lower_whole
        from ...partitioner import MLXPartitioner

        ep = trace(module, example, dynamic, model_dir)
        attend_written_prefix(ep, slots)
        fuse_shared_input_projections(ep)
        stage("lowering to MLX (torch's decompositions, then our handlers node by node)")
        weights = output_path.with_suffix(".ptd") if o.external_weights else None
        partitioner = MLXPartitioner(activations, weights and weights.stem)
        quantization = quantization_label(config, model_dir, fmt, embedded, activations)
        meta = metadata(config, max_context, max_chunk, sampling, quantization, logprobs, o.token_mask,
                        max_draft_tokens, rewind, weights and weights.name, top_logprobs)
        if max_batch > 1:
            meta[program_contract.MAX_BATCH] = max_batch
        edge = lower_whole(ep, partitioner, meta)
        del ep, module, lm, model  # the delegate's weights are in the named data store now
        refuse_ops_outside(partitioner, model_dir, model_path)
        drop_unused_constants(edge.exported_program())
        program = edge.to_executorch()
        if weights is not None:  # first: the old program fails to find its weights in it, never runs on them
            stage(f"writing {weights}")
            write_data_file(program, weights)
        stage(f"writing {output_path}")
        # the size ExecuTorch will write (its Cord of segments), for the bar; 0 hides it
        size = len(getattr(program, "_pte_data", b""))
        with counter("writing", size, "MiB", 2**20) as count:
            write_atomically(output_path, lambda file: program.write_to_file(CountingWriter(file, count)))
    sizes = [output_path] + ([weights] if weights is not None else [])
    stage("done: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in sizes))
    return output_path
