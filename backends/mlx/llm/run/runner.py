"""Text in, text out: runs a `.pte` made by `export_llm` with its tokenizer.

    runner = LLMRunner("model.pte", "model_dir")
    result = runner.generate("Once upon a time", max_new_tokens=32, temperature=0.8, seed=42,
                             on_text=lambda s: print(s, end="", flush=True))
    reply = runner.chat([{"role": "user", "content": "Hi"}], max_new_tokens=32)
    called = runner.chat(messages, tools=tools, tool_choice="required")  # .tool_calls (tool_calls.py)

The prompt prefills in one call (in chunks of the program's maximum length
above it); each decode step is one call that returns the next token id,
sampled on the device. Inputs are found by name from the program's metadata.

The runner remembers the token ids its KV cache holds: a prompt that begins
with them (the next turn of a conversation) prefills only what follows the
longest common prefix. Generation ends at any eos id of the program and of
the tokenizer folder (generation_config.json, config.json, the tokenizer's
eos token), at a stop string, or after `max_new_tokens`.

Threads: a runner may be loaded in one thread and used from any other. One
runner shared by several threads serializes their calls (a lock around
`generate` and `reset`: the program has one KV cache, so two generations
cannot interleave); for parallel generations, use one runner per thread.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from functools import cached_property
from itertools import takewhile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .. import program_contract
from .drafting import DraftLength, DraftModel, PromptLookup
from .channels import FinalChannel
from .chat import ChatTemplate, check_stop, end_of_generation_ids, template_source
from .decode_parts import SamplerFeed, StopRules, TextOut
from .gguf_tokenizer import gguf_tokenizer_folder, is_gguf_file
from .plan import Plan
from .program_runner import ProgramRunner
from .text_limits import check_fits, check_unicode, longest_token_bytes
from .tool_calls import ToolFormat, ToolUse, check_tool_choice, check_tools, template_tool_format
from ...serialization.sampler_params import ROW_PARAMS, TABLE_PARAMS
from ..sampler_inputs import OFF, PENALTIES, TOKEN_MASK, logit_bias_tensors, sampling_inputs


class Logprob(float):
    """A generated token's log-probability, a float. From a program exported
    with top_logprobs K, `top` holds the K most likely (token id,
    log-probability) pairs of that step, most likely first."""

    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, value: float, ids: list[int], values: list[float]) -> Logprob:
        logprob = cls(value)
        logprob.top = tuple(zip(ids, values))
        return logprob


@dataclass
class GenerationResult:
    token_ids: list[int]  # the generated ids only
    text: str  # cut before a stop string; with tools, the text before the first call
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    # or "eos", "stop" (a stop string), "cancelled" (by on_token), "grammar" (it allows nothing more)
    stop_reason: str = "max_new_tokens"
    logprobs: list[Logprob] | None = None  # per generated token, from a program exported with logprobs
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache entries were reused, not prefilled
    draft_tokens: int = 0  # tokens a drafter proposed (speculative decoding)
    accepted_tokens: int = 0  # of those, the ones verification accepted
    tool_calls: list | None = None  # tool_calls.ToolCall of a chat with tools, when the model called
    step_seconds: list[float] = field(default_factory=list, repr=False)


def load_tokenizer(tokenizer_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} is missing: pass the model folder (with tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None


class LLMRunner(ProgramRunner):
    def __init__(self, pte: str | Path | bytes, tokenizer_dir: str | Path | None = None, *,
                 data_path: str | Path | None = None):
        """`tokenizer_dir`: the model's Hugging Face folder (tokenizer.json,
        its chat template and eos tokens), or the .gguf file it came from.
        `data_path`: the weights file of a program exported with
        --external-weights (default: the one its metadata names, beside it)."""
        super().__init__(pte, data_path=data_path)
        one = self.contract.one
        self.samples = self.contract.samples
        self.max_context = one(program_contract.MAX_CONTEXT_LEN, int)
        self.max_chunk = one(program_contract.MAX_SEQ_LEN, int)
        self.vocab_size = one(program_contract.VOCAB_SIZE, int)
        eos = self.contract.metadata.get(program_contract.EOS_IDS, [])
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ValueError(f"this .pte's '{program_contract.EOS_IDS}' metadata is not a list of ints")
        self.eos_ids = set(eos)
        if not (2 <= self.max_context and 1 <= self.max_chunk and 1 <= self.vocab_size):
            raise ValueError(f"this .pte's metadata is inconsistent (max context {self.max_context}, max chunk "
                             f"{self.max_chunk}, vocab size {self.vocab_size})")
        llm_inputs = list(program_contract.LLM_INPUTS)
        if self.input_names[:2] != llm_inputs:
            raise ValueError(f"this .pte takes {', '.join(self.input_names)}; an LLM program takes "
                             f"{' and '.join(llm_inputs)} first: export it with executorch-mlx export")
        for name in TABLE_PARAMS:  # read as [batch, slots] below
            if len(self.input_shapes.get(name, (1, 0))) != 2:
                raise ValueError(f"this .pte's input '{name}' has shape {list(self.input_shapes[name])}, not "
                                 f"[batch, size]: export it with executorch-mlx export")
        if tokenizer_dir is not None and is_gguf_file(tokenizer_dir):  # llama.cpp's file: its own vocabulary
            self._gguf_tokenizer = gguf_tokenizer_folder(tokenizer_dir)  # (the folder lives with the runner)
            tokenizer_dir = Path(self._gguf_tokenizer.name)
        self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        self.tokenizer_dir = tokenizer_dir
        if tokenizer_dir is not None:
            self.eos_ids |= end_of_generation_ids(tokenizer_dir, self.tokenizer)
        self._chat_template = None
        self._grammar_tokenizer = None  # built on the first structured generation
        # A sliding-window cache wraps around: positions past a common prefix
        # may have overwritten what the prefix needs (unknown: assume it does),
        # except within the last `cache_rewind` positions written (llm/export/ring_cache.py).
        self.cache_wraps = self.contract.one(program_contract.CACHE_WRAPS, bool, True)
        self.cache_rewind = self.contract.one(program_contract.CACHE_REWIND, int, 0) if self.cache_wraps else None
        # Drafts one call verifies (llm/export/speculative.py); 0 for programs exported before.
        self.max_draft_tokens = self.contract.one(program_contract.MAX_DRAFT_TOKENS, int, 0)
        if self.max_draft_tokens and "history" in self.input_shapes:
            # Its size reads as the most rows it takes; a call samples as many
            # rows as its history has: one, unless drafts are verified.
            self.input_shapes = {**self.input_shapes, "history": (1, self.input_shapes["history"][1])}
        # A batched program (llm/export/batched.py) runs up to max_batch rows a
        # call; this runner's own generations run one, in row 0 (batch.py runs many).
        self.max_batch = self.contract.one(program_contract.MAX_BATCH, int, 1)
        if self.max_batch > 1:
            self.input_shapes = {name: shape if name in llm_inputs else (1, *shape[1:])
                                 for name, shape in self.input_shapes.items()}
        self._cached: list[int] = []  # the ids whose keys and values the cache holds, from position 0
        self._cache_epoch = _reset_epoch()
        self.prompt_cache = None  # use_prompt_cache
        # One generation at a time: the steps of two would interleave in the
        # one KV cache and give wrong tokens (see the module's docstring).
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Empties the KV cache (of every program loaded in this process)."""
        import executorch_mlx

        with self._lock:
            self._cached = []
            executorch_mlx.reset_state()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_source)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer folder's chat template, loaded on first use (it imports transformers)."""
        if self._chat_template is None and self.has_chat_template:
            self._chat_template = ChatTemplate(self.tokenizer_dir)
        return self._chat_template

    def chat_prompt(self, messages: list[dict], system_prompt: str | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The token ids of `messages` under the tokenizer folder's chat
        template, the assistant's turn opened, `tools` shown as it shows them."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer folder {self.tokenizer_dir} has no chat template "
                             f"(tokenizer_config.json chat_template or chat_template.jinja)")
        for i, m in enumerate(messages):
            self.check_text(m.get("content") if isinstance(m, dict) else None, f"messages[{i}].content")
        if system_prompt is not None:
            self.check_text(system_prompt, "system prompt")
        return self.encode(self.chat_template.render(messages, system_prompt, tools), "messages",
                           add_special_tokens=False)  # the template wrote them

    @property
    def tool_format(self) -> ToolFormat | None:
        """The tool-call format the chat template teaches (None: no template, or one without tools)."""
        return template_tool_format(self._template_source)

    def final_channel(self) -> FinalChannel | None:
        """For a model that answers in channels (gpt-oss's harmony, seen in
        its template): one answer's picker of the final channel's tokens."""
        if self.tokenizer is None:
            return None
        return FinalChannel.of(self._template_source, self.tokenizer)

    @cached_property
    def _template_source(self) -> str:
        """The chat template's text, read once ("" for none)."""
        return template_source(self.tokenizer_dir) if self.tokenizer_dir is not None else ""

    def tool_use(self, tools, tool_choice=None, parallel_tool_calls: bool = True) -> ToolUse | None:
        """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked
        (ValueError) against this folder's template: None without tools."""
        if tools is None or tools == []:
            if tool_choice not in (None, "auto", "none"):
                raise ValueError("tool_choice needs tools")
            return None
        tools = check_tools(tools)
        choice = check_tool_choice(tool_choice, tools)
        if not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}")
        form = self.tool_format
        if form is None:
            raise ValueError(f"the chat template of {self.tokenizer_dir} shows no tools in a format we read "
                             f"(Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS] or gpt-oss)")
        return ToolUse.build(self.tokenizer, form, tools, choice, parallel_tool_calls)

    def check_text(self, text, what: str) -> None:
        """ValueError for text that is not valid Unicode; ContextLengthError
        (a ValueError) for text that cannot fit the context (text_limits.py).
        Anything but a str passes (the callers check their types)."""
        if not isinstance(text, str) or self.tokenizer is None:
            return
        check_unicode(text, what)
        check_fits(text, what, self.max_context, self.max_token_bytes)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token covers (text_limits.py); measured
        on first use: it reads the whole vocabulary."""
        return longest_token_bytes(self.tokenizer)

    def encode(self, text: str, what: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`, checked first (check_text)."""
        if self.tokenizer is None:
            raise ValueError(f"a text {what} needs a tokenizer: pass tokenizer_dir")
        self.check_text(text, what)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def chat(self, messages: list[dict], system_prompt: str | None = None, *, tools: list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True, **kwargs) -> GenerationResult:
        """generate() on the chat template's rendering of `messages`
        ([{"role": "user", "content": "..."}, ...]). A follow-up that repeats
        the conversation so far reuses its cache entries. `tools`,
        `tool_choice` and `parallel_tool_calls` are OpenAI's (tool_calls.py):
        the result's `tool_calls` holds the calls the model made."""
        use = self.tool_use(tools, tool_choice, parallel_tool_calls)
        return self.generate(self.chat_prompt(messages, system_prompt, use and use.tools), tool_use=use, **kwargs)

    @property
    def cached_tokens(self) -> list[int]:
        """The ids whose entries the program's cache holds, from position 0."""
        epoch = _reset_epoch()
        if epoch != self._cache_epoch:  # someone emptied or replaced every cache
            self._cached, self._cache_epoch = [], epoch
        return self._cached

    @cached_tokens.setter
    def cached_tokens(self, ids: list[int]) -> None:
        """(after restoring a state snapshot that holds them: prompt_cache.py)"""
        self._cached, self._cache_epoch = list(ids), _reset_epoch()

    def reusable(self, ids: list[int], held: list[int] | None = None) -> int:
        """How many leading ids need no prefill: the common prefix with what
        the cache holds (`held`, default the live cache's `cached_tokens`;
        at least one id is always run, for its logits)."""
        held = self.cached_tokens if held is None else held
        n = 0
        for a, b in zip(held, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        if self.cache_wraps and len(held) - n > self.cache_rewind:
            n = 0  # too far back: the window of position n may be overwritten
        return n

    def use_prompt_cache(self, max_bytes: int) -> None:
        """Keeps other conversations' caches for their next turns, up to
        `max_bytes` of them (llm/run/prompt_cache.py); 0 turns it off."""
        from .prompt_cache import PromptCache

        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        self.prompt_cache = PromptCache(max_bytes) if max_bytes else None

    def _step(self, ids: list[int], start: int, sampling: list[np.ndarray],
              constrained: bool = False) -> tuple[list[int], list[float | None]]:
        """One call: `ids` at positions start, start + 1, ...; returns the
        emitted tokens (one, or with drafts last in `ids` and a history row
        per draft, the accepted drafts and the next token) and their logprobs."""
        positions = np.arange(start, start + len(ids), dtype=np.int64)
        values = [np.array([ids], dtype=np.int64), positions[None] if self.max_batch > 1 else positions]
        known, self._cached = self._cached[:start], []  # unknown if the call fails
        outputs = self.execute(values + sampling)
        self._cached = known + ids
        out = outputs[0]
        if self.samples:
            tokens = out.reshape(-1).tolist()
            # -1 ends the emitted tokens (a first -1: nothing could be sampled)
            emitted = tokens[:1] + list(takewhile(lambda t: t >= 0, tokens[1:]))
        else:  # greedy as the sampler: NaN never chosen, -1 when nothing can be
            row = out.reshape(-1, out.shape[-1])[-1].astype(np.float32)
            row = np.where(np.isnan(row), -np.inf, row)
            emitted = [int(np.argmax(row)) if bool((row > -np.inf).any()) else -1]
        for token in emitted:
            self._check_token(token, constrained)
        return emitted, self.read_logprobs(outputs, len(emitted))

    def read_logprobs(self, outputs: list, count: int, first: int = 0) -> list[Logprob | None]:
        """The log-probabilities of the `count` tokens sampled from row
        `first` on of a call's `outputs` (None each, from a program without)."""
        if not self.logprobs:
            return [None] * count
        rows = slice(first, first + count)
        values = outputs[1].reshape(-1)[rows].tolist()
        if not self.contract.top_logprobs:
            return [Logprob(v) for v in values]
        ids, tops = (outputs[i][rows].tolist() for i in (2, 3))
        return [Logprob.of(v, i, t) for v, i, t in zip(values, ids, tops)]

    def stop_rules(self, plan: Plan, on_text, on_token) -> StopRules:
        """Why a generation of `plan` ends, its text (rules.text) streamed to `on_text`."""
        text = TextOut(self.tokenizer, plan.stops, on_text, tool_use=plan.tool_use, eos_ids=self.eos_ids,
                       channels=self.final_channel())
        return StopRules(self.eos_ids, plan.constraint, text, on_token, plan.max_new_tokens)

    def _check_token(self, token: int, constrained: bool) -> None:
        if not 0 <= token < self.vocab_size:
            if constrained:
                raise RuntimeError(f"the model produced no valid token (id {token}): the grammar allows no token "
                                   f"whose logit is finite here")
            raise RuntimeError(f"the model produced no valid token (id {token}): its logits are all NaN or -inf")
        if self.tokenizer is not None and token >= self._tokenizer_size:
            # (a model's vocabulary may be padded beyond its tokenizer's, as
            # Qwen2.5's and Phi-3's are: refused when such an id comes, not at load)
            raise RuntimeError(f"the model generated token id {token}, which its tokenizer does not have "
                               f"({self._tokenizer_size} tokens; the model has {self.vocab_size}): "
                               f"is this the model's tokenizer?")

    @cached_property
    def _tokenizer_size(self) -> int:
        """The tokenizer's vocabulary size, read once: tokenizers builds its
        whole vocabulary to count it (3 ms a call for 32000 tokens)."""
        return self.tokenizer.get_vocab_size()

    def generate(self, prompt: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 seed: int | None = None, on_text: Callable[[str], None] | None = None, *,
                 on_token: Callable[[int, float | None], bool] | None = None, **options) -> GenerationResult:
        """Prefills `prompt` (text, taken as it is, or token ids), then decodes
        on the device until an end-of-generation id, a stop string or
        `max_new_tokens`: run(prepare(...)). `options` are prepare()'s, which
        says what each does. `on_text(piece)` gets the text as it grows;
        `on_token(id, logprob)` is called with each generated token (logprob
        None from a program without logprobs) before its text is streamed;
        returning True ends the generation there ("cancelled").
        Calls from several threads run one at a time."""
        return self.run(self.prepare(prompt, max_new_tokens, temperature, seed, **options), on_text, on_token)

    def prepare(self, prompt: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                seed: int | None = None, *, repetition_context_size: int = 20,
                logit_bias: dict[int, float] | None = None, stop: str | list[str] | None = None,
                json_schema=None, regex: str | None = None, grammar: str | None = None,
                draft: LLMRunner | str | None = None, num_draft_tokens: int | None = None,
                adaptive_drafting: bool = True, tool_use: ToolUse | None = None, **params) -> Plan:
        """One generation, checked and ready to run (ValueError for the first
        thing wrong): the prompt tokenized, the sampler inputs built, the
        grammar compiled, the drafter made. A Plan runs once.

        temperature <= 0 is greedy. Sampling is seeded: the same seed, prompt
        and settings give the same tokens (seed None means 0). `params` are
        the row parameters of the sampler table (mlx-lm's names; each
        defaults to its off value), as docs/sampling.md defines them; the
        penalties count the last `repetition_context_size` tokens
        of prompt and output. `logit_bias` maps token ids to values added to
        their logits (-inf bans a token). `stop` strings end the text before
        them (also across tokens, and never streamed).
        Structured output: `json_schema` (a dict, JSON text or a .json path),
        `regex` or `grammar` (Lark text or a .lark path) constrains every
        generated token on the device (llm/run/grammar.py); the generation ends
        when the model ends it where the grammar accepts ("eos") or when the
        grammar allows nothing more ("grammar"). JSON comes out compact.
        Speculative decoding: `draft` ("prompt-lookup", or an LLMRunner of a
        smaller program of the same tokenizer) proposes up to
        `num_draft_tokens` tokens (default: the most the program verifies),
        which the program verifies in one call (llm/export/speculative.py): the
        output is exactly plain decoding's. `adaptive_drafting` drafts fewer
        (or none for a while) when few are accepted (llm/run/drafting.py).
        `tool_use` (tool_use()): the answer's calls are read into the
        result's `tool_calls`, and a required or named call is forced."""
        unknown = sorted(set(params) - set(ROW_PARAMS))
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s) {', '.join(unknown)}")
        stops = check_stop(stop)
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer_dir")
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(ids)} tokens; this program's max context is {self.max_context} "
                             f"(room for the prompt and at least one generated token): re-export with a larger "
                             f"--max-context")
        if len(ids) + max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the max "
                             f"context of {self.max_context}: the KV cache would overflow")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        params = {name: value for name, value in params.items() if value != OFF[name]}
        penalized = any(name in PENALTIES for name in params)
        if isinstance(repetition_context_size, bool) or not isinstance(repetition_context_size, int) or \
                repetition_context_size < 1:
            raise ValueError(f"repetition_context_size must be a positive int, got {repetition_context_size!r}")
        history_size = self.input_shapes.get("history", (1, 0))[1]
        if penalized and repetition_context_size > history_size:
            raise ValueError(f"repetition_context_size {repetition_context_size} exceeds this program's history "
                             f"of {history_size} tokens (export with a larger history_size)")
        if logit_bias:
            slots = self.input_shapes.get("logit_bias_ids", (1, 0))[1]
            params["logit_bias_ids"], params["logit_bias_values"] = logit_bias_tensors(logit_bias, slots,
                                                                                       self.vocab_size)
        if not self.samples and (temperature > 0 or params):
            raise ValueError("this program returns logits (exported with --no-sampling): only greedy decoding")
        # checked before anything runs; the history and the mask are filled in per step
        sampling = sampling_inputs(1, temperature, 0 if seed is None else seed, 0, vocab=self.vocab_size,
                                   **params) if self.samples else {}
        if tool_use is not None and tool_use.grammar is not None:
            if json_schema is not None or regex is not None or grammar is not None:
                raise ValueError(f"a forced tool call (tool_choice {tool_use.choice!r}) is a grammar of its own: "
                                 f"give no json_schema, regex or grammar with it")
            grammar = tool_use.grammar
        constraint = self.constraint(json_schema=json_schema, regex=regex, grammar=grammar)
        drafter = self.drafter(draft, num_draft_tokens, constraint is not None)
        draft_length = DraftLength(num_draft_tokens or self.max_draft_tokens, adaptive_drafting) if drafter else None
        return Plan(ids, max_new_tokens, sampling, repetition_context_size if penalized else 0, stops, constraint,
                    drafter, draft_length, tool_use, runner=self)

    def run(self, plan: Plan, on_text: Callable[[str], None] | None = None,
            on_token: Callable[[int, float | None], bool] | None = None) -> GenerationResult:
        """Runs a Plan of this runner's prepare() (see generate())."""
        plan.claim(self)
        draft_lock = plan.drafter.runner._lock if isinstance(plan.drafter, DraftModel) else nullcontext()
        with self._lock, draft_lock:
            return self._generate(plan, on_text, on_token)

    def drafter(self, draft, num_draft_tokens: int | None, constrained: bool = False):
        """The drafter for `draft` ("prompt-lookup" or an LLMRunner), or None;
        ValueError for what this program cannot verify."""
        if draft is None:
            if num_draft_tokens is not None:
                raise ValueError("num_draft_tokens needs a draft (a draft model or prompt lookup)")
            return None
        if isinstance(draft, str):
            if draft != PromptLookup.name:
                raise ValueError(f"draft must be {PromptLookup.name!r} or an LLMRunner of a draft model, got {draft!r}")
            drafter = PromptLookup()
        elif isinstance(draft, LLMRunner):
            if draft is self:
                raise ValueError("the draft model must be another LLMRunner (its own KV cache), not the target's")
            drafter = DraftModel(draft)
        else:
            raise TypeError(f"draft must be {PromptLookup.name!r} or an LLMRunner, got {type(draft).__name__}")
        if not self.max_draft_tokens:
            raise ValueError("this program verifies no drafts (exported with --max-draft-tokens 0, --no-sampling or "
                             "before speculative decoding): re-export it to use a draft")
        if num_draft_tokens is not None and (isinstance(num_draft_tokens, bool) or not isinstance(
                num_draft_tokens, int) or not 1 <= num_draft_tokens <= self.max_draft_tokens):
            raise ValueError(f"num_draft_tokens must be in [1, {self.max_draft_tokens}] (this program's "
                             f"--max-draft-tokens), got {num_draft_tokens!r}")
        if self.cache_wraps and self.cache_rewind < (num_draft_tokens or self.max_draft_tokens):
            # (programs exported before ring caches: every rewind may lose the window)
            raise NotImplementedError("speculative decoding with a sliding-window cache that wraps around (rejected "
                                      "drafts would overwrite entries still in the window): re-export the program")
        if constrained:
            raise NotImplementedError("speculative decoding with structured output (the grammar's mask of each "
                                      "drafted position)")
        drafter.check(self)
        return drafter

    def constraint(self, **grammar):
        """A fresh TokenConstraint for json_schema, regex or grammar (None
        for none); ValueError for a bad grammar or a program without a mask."""
        from .grammar import TokenConstraint, grammar_text, grammar_tokenizer

        text = grammar_text(**grammar)
        if text is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer: pass tokenizer_dir")
        if not self.samples or TOKEN_MASK not in self.input_names:
            raise ValueError("this program takes no token mask (exported with --no-sampling or --no-grammar, or "
                             "before structured output): re-export it for json_schema, regex or grammar")
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        return TokenConstraint(text, self._grammar_tokenizer, self.eos_ids)

    def _generate(self, plan: Plan, on_text, on_token) -> GenerationResult:
        ids, max_new_tokens, drafter = plan.prompt_ids, plan.max_new_tokens, plan.drafter
        feed = SamplerFeed(plan)
        constrained = plan.constraint is not None
        # What the cache holds past the common prefix is overwritten or never
        # read: attention never looks past the current position, so no reset
        # (reset_state() would also empty the caches of other programs).
        if self.prompt_cache is not None:
            self.prompt_cache.prepare(self, ids)
        cached = self.reusable(ids)

        t0 = time.perf_counter()
        for start in range(cached, len(ids), self.max_chunk):
            emitted, logprobs = self._step(ids[start:start + self.max_chunk], start, feed(self, 0, ids), constrained)
        if drafter is not None and max_new_tokens > 1:  # (one token: no round drafts)
            drafter.prefill(ids, feed)
        prefill_s = time.perf_counter() - t0

        out = emitted
        rules = self.stop_rules(plan, on_text, on_token)
        text = rules.text
        stop = rules.check(out, logprobs)
        steps, drafted, accepted = [], 0, 0
        while stop is None:
            # out[-1] is not in the cache yet: this call writes it at `position`
            position = len(ids) + len(out) - 1
            t = time.perf_counter()  # a step's time includes its drafting
            drafts = []
            if drafter is not None:
                # the emitted tokens (drafts + 1) fit max_new_tokens, their entries the cache
                room = min(max_new_tokens - len(out) - 1, self.max_context - 1 - position)
                k = min(plan.draft_length.next(), room)
                drafts = drafter.propose(ids + out, k, len(out), feed) if k > 0 else []
            emitted, emitted_logprobs = self._step([out[-1]] + drafts, position,
                                                   feed(self, len(out), ids + out, drafts), constrained)
            steps.append(time.perf_counter() - t)
            if drafter is not None:
                drafted, accepted = drafted + len(drafts), accepted + len(emitted) - 1
                plan.draft_length.update(len(drafts), len(emitted) - 1)
            for token, logprob in zip(emitted, emitted_logprobs):
                out.append(token)
                logprobs.append(logprob)
                stop = rules.check(out, logprobs)
                if stop is not None:
                    break
        text.update(out, final=True)
        return GenerationResult(token_ids=out, text=text.result(out),
                                prefill_tokens_per_s=(len(ids) - cached) / prefill_s,
                                decode_tokens_per_s=(len(out) - 1) / sum(steps) if steps else 0.0,
                                stop_reason=stop, step_seconds=steps,
                                logprobs=logprobs if self.logprobs else None,
                                prompt_tokens=len(ids), cached_tokens=cached, draft_tokens=drafted,
                                accepted_tokens=accepted, tool_calls=text.tool_calls)

def _reset_epoch() -> int:
    import executorch_mlx._runtime_library as library

    return library.reset_count
