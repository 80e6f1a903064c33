"""The contract between an exported program and its runners: the metadata
(constant methods) a program carries and the names of its inputs. Written
here by export (`llm_metadata`, `head_metadata`) and read here by the
Python runners (`read`); the C++ runner reads the same names from
runtime/generated/program_contract.h, which generate.py writes from the
constants below (so this module imports nothing at load time but stdlib).

Two kinds of program carry it:
* LLM programs (`export_llm`): inputs `input_ids` [1, S] and
  `cache_position` [S], then, when they sample, every sampler input of the
  table (serialization/sampler_params.py) in its order. They return the
  next token id [1] (and its logprob) or, exported without sampling, the
  last position's logits. A history of R rows verifies R - 1 drafts fed
  last (llm/export/speculative.py): out come R tokens, -1 after the accepted ones.
* sampling heads (`export_sampling_head`, `export_greedy_head`): the model's
  inputs (the first a token window [B, S]), then the sampler inputs they
  were exported with. They return token ids [B] (and logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ExecuTorch's LLM-runner metadata names (its TextLLMRunner reads them too).
MAX_SEQ_LEN = "get_max_seq_len"
MAX_CONTEXT_LEN = "get_max_context_len"
VOCAB_SIZE = "get_vocab_size"
USE_KV_CACHE = "use_kv_cache"
ENABLE_DYNAMIC_SHAPE = "enable_dynamic_shape"
USE_SDPA_WITH_KV_CACHE = "use_sdpa_with_kv_cache"
BOS_ID = "get_bos_id"
EOS_IDS = "get_eos_ids"
# Ours.
INPUT_NAMES = "emlx_input_names"  # a string: the method's input names, comma-separated
SAMPLES = "emlx_samples"  # bool: the first output is token ids (else logits)
LOGPROBS = "emlx_logprobs"  # bool: the second output is their log-probabilities
# int K: then the K most likely tokens of each row, ids int64 [R, K] and
# log-probabilities float32 [R, K], most likely first (absent: none)
TOP_LOGPROBS = "emlx_top_logprobs"
# the most TOP_LOGPROBS an export takes (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20
MODEL_TYPE = "emlx_model_type"
QUANTIZATION = "emlx_quantization"
MAX_DRAFT_TOKENS = "emlx_max_draft_tokens"  # int: drafts one call verifies (llm/export/speculative.py)
CACHE_WRAPS = "emlx_cache_wraps"  # bool: a sliding-window cache shorter than the context (it wraps around)
# int: with CACHE_WRAPS, how many positions before the end of what the cache
# was written a call may start (rewind) without losing its window (llm/export/ring_cache.py)
CACHE_REWIND = "emlx_cache_rewind"
# a string: the ExecuTorch data file (.ptd) that holds the weights, expected
# beside the .pte; absent when the .pte holds them
WEIGHTS_FILE = "emlx_weights_file"
# int N: a batched program (llm/export/batched.py) runs up to N sequences per
# call, its input_ids and cache_position [B, S] and its sampler inputs one
# per row (absent: one sequence, cache_position [S])
MAX_BATCH = "emlx_max_batch"
# The first inputs of an LLM program.
LLM_INPUTS = ("input_ids", "cache_position")

# The drafting policy of speculative decoding (llm/run/drafting.py), which the
# C++ runner (runtime/llm_runner.cpp) follows too: prompt lookup matches the
# context's last PROMPT_LOOKUP_MAX_NGRAM down to _MIN_NGRAM tokens; adaptive
# drafting starts at DRAFT_START tokens and, after a lost one-token round,
# pauses DRAFT_BACKOFF_MIN steps, growing DRAFT_BACKOFF_GROWTH-fold up to _MAX.
PROMPT_LOOKUP_MAX_NGRAM, PROMPT_LOOKUP_MIN_NGRAM = 3, 1
DRAFT_START = 1
DRAFT_BACKOFF_MIN, DRAFT_BACKOFF_GROWTH, DRAFT_BACKOFF_MAX = 4, 4, 256

# What generate.py writes into runtime/generated/program_contract.h: names...
CPP_CONSTANTS = {
    "kMaxSeqLen": MAX_SEQ_LEN, "kMaxContextLen": MAX_CONTEXT_LEN, "kVocabSize": VOCAB_SIZE, "kEosIds": EOS_IDS,
    "kInputNames": INPUT_NAMES, "kSamples": SAMPLES, "kLogprobs": LOGPROBS, "kBosId": BOS_ID,
    "kMaxDraftTokens": MAX_DRAFT_TOKENS, "kWeightsFile": WEIGHTS_FILE, "kMaxBatch": MAX_BATCH,
    "kInputIds": LLM_INPUTS[0], "kCachePosition": LLM_INPUTS[1],
}
# ... and numbers.
CPP_INTEGERS = {
    "kPromptLookupMaxNgram": PROMPT_LOOKUP_MAX_NGRAM, "kPromptLookupMinNgram": PROMPT_LOOKUP_MIN_NGRAM,
    "kDraftStart": DRAFT_START, "kDraftBackoffMin": DRAFT_BACKOFF_MIN, "kDraftBackoffGrowth": DRAFT_BACKOFF_GROWTH,
    "kDraftBackoffMax": DRAFT_BACKOFF_MAX,
}

_EXPORT_HINT = "export it with executorch-mlx export"


def head_metadata(input_names: list[str], logprobs: bool) -> dict:
    """The metadata of a sampling (or greedy) head."""
    return {INPUT_NAMES: ",".join(input_names), SAMPLES: True, LOGPROBS: logprobs}


def llm_metadata(config: dict, max_context: int, max_chunk: int, sampling: bool, quantization: str,
                 logprobs: bool, sampler_inputs: tuple[str, ...], max_draft_tokens: int = 0,
                 cache_rewind: int | None = None, weights_file: str | None = None, top_logprobs: int = 0) -> dict:
    """The metadata of an LLM program: ExecuTorch's names, then ours.
    `cache_rewind`: None when the cache keeps every position, else how far
    back from its end a call may start (a ring-buffer cache); `weights_file`:
    the .ptd holding the weights, or None; `top_logprobs`: K (TOP_LOGPROBS)."""
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    bos = config.get("bos_token_id")
    return {
        MAX_SEQ_LEN: max_chunk,
        MAX_CONTEXT_LEN: max_context,
        VOCAB_SIZE: int(config["vocab_size"]),
        USE_KV_CACHE: True,
        ENABLE_DYNAMIC_SHAPE: True,
        USE_SDPA_WITH_KV_CACHE: False,
        BOS_ID: -1 if bos is None else int(bos),
        EOS_IDS: [int(e) for e in eos_ids],
        SAMPLES: sampling,
        LOGPROBS: logprobs,
        INPUT_NAMES: ",".join(LLM_INPUTS + (sampler_inputs if sampling else ())),
        MODEL_TYPE: config["model_type"],
        QUANTIZATION: quantization,
        CACHE_WRAPS: cache_rewind is not None,
        CACHE_REWIND: cache_rewind or 0,
        MAX_DRAFT_TOKENS: max_draft_tokens,
        **({WEIGHTS_FILE: weights_file} if weights_file else {}),
        **({TOP_LOGPROBS: top_logprobs} if top_logprobs else {}),
    }


@dataclass
class Contract:
    """What a loaded program says about itself."""

    input_names: list[str]
    input_shapes: dict[str, tuple[int, ...]]
    input_dtypes: dict  # name -> numpy dtype, or loaded_program.BFLOAT16
    output_dtypes: list
    output_shapes: list[tuple[int, ...]]
    samples: bool
    logprobs: bool
    metadata: dict[str, list] = field(repr=False)
    weights_file: str | None = None  # WEIGHTS_FILE
    top_logprobs: int = 0  # TOP_LOGPROBS

    def one(self, name: str, kind: type, default=None, hint: str = _EXPORT_HINT):
        """A metadata method's single value of type `kind`; ValueError otherwise."""
        values = self.metadata.get(name)
        if values is None and default is not None:
            return default
        if values is None or len(values) != 1 or not isinstance(values[0], kind) or (
                kind is int and isinstance(values[0], bool)):
            raise ValueError(f"this .pte's '{name}' metadata is missing or not one {kind.__name__}: {hint}")
        return values[0]


class NoContract(ValueError):
    """The program carries no input names: not exported by this package."""


def read(program, method: str = "forward", hint: str = _EXPORT_HINT) -> Contract:
    """The contract of `method` of a LoadedProgram (loaded_program.py), from
    its metadata methods: read_signature adds the method's inputs and
    outputs once it is loaded (after its data file, if it has one).
    NoContract when it has none; ValueError (ending in `hint`) when it is
    malformed."""
    names = program.method_names
    if INPUT_NAMES not in names:
        raise NoContract(f"this .pte has no {INPUT_NAMES} metadata: {hint}")
    metadata = {n: program.load_method(n).execute([]) for n in names if n != method}
    contract = Contract([], {}, {}, [], [], False, False, metadata)
    contract.input_names = contract.one(INPUT_NAMES, str, hint=hint).split(",")
    contract.samples = contract.one(SAMPLES, bool, hint=hint)
    contract.logprobs = contract.one(LOGPROBS, bool, False, hint=hint)
    contract.top_logprobs = contract.one(TOP_LOGPROBS, int, 0, hint=hint)
    if not 0 <= contract.top_logprobs <= MAX_TOP_LOGPROBS or (contract.top_logprobs and not contract.logprobs):
        raise ValueError(f"this .pte's {TOP_LOGPROBS} ({contract.top_logprobs}) is not in [1, {MAX_TOP_LOGPROBS}] "
                         f"beside {LOGPROBS}: {hint}")
    if WEIGHTS_FILE in metadata:
        contract.weights_file = contract.one(WEIGHTS_FILE, str, hint=hint)
    return contract


def read_signature(contract: Contract, loaded, hint: str = _EXPORT_HINT) -> None:
    """The input shapes and dtypes, by name, and the outputs' of the loaded
    method (a LoadedMethod) the contract describes."""
    if len(loaded.inputs) != len(contract.input_names):
        raise ValueError(f"this .pte's {INPUT_NAMES} names {len(contract.input_names)} inputs; the method takes "
                         f"{len(loaded.inputs)}: {hint}")
    for name, spec in zip(contract.input_names, loaded.inputs):
        if spec is None:
            raise ValueError(f"this .pte's input '{name}' is not a tensor: {hint}")
        contract.input_shapes[name], contract.input_dtypes[name] = spec.shape, spec.dtype
    for spec in loaded.outputs:
        contract.output_shapes.append(spec.shape if spec else ())
        contract.output_dtypes.append(spec.dtype if spec else None)
