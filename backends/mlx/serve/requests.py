"""OpenAI-style request bodies -> checked generate() arguments.

Everything is checked here, before a request is queued: an invalid value is
a `RequestError` naming the field (HTTP 400 with OpenAI's error body). The
body itself first (decode_body): JSON, at most MAX_JSON_DEPTH deep, its
strings valid Unicode.
Unknown fields are ignored, as OpenAI's server does. The sampler's fields
are the table's (serialization/sampler_params.py, its `openai` names) and
are checked by the same function the runner uses (`sampling_inputs`).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

from ..llm.run.chat import check_messages, check_stop
from ..llm.run.plan import Plan
from ..llm.run.runner import LLMRunner
from ..llm.run.text_limits import ContextLengthError, check_unicode
from ..llm.sampler_inputs import PENALTIES, logit_bias_tensors, sampling_inputs
from ..serialization.sampler_params import BY_NAME, ROW_PARAMS, SAMPLER_INPUTS

# OpenAI's logit_bias range; its ends ban a token or force it.
BIAS_LIMIT = 100.0
DEFAULT_REPETITION_CONTEXT = 20
# Deeper JSON is refused before any field is read (a JSON schema nests about
# three levels a level of its objects).
MAX_JSON_DEPTH = 128
# `n`: the most choices one request asks for (they run one after another)
MAX_CHOICES = 16
# choice i's seed is the request's plus i times this (mod 2**64): 2**64 over
# the golden ratio, splitmix64's step, so choices of nearby seeds do not meet
CHOICE_SEED_STEP = 0x9E3779B97F4A7C15


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class Request:
    """A request, checked: the runner's Plan of each choice (prepared once,
    its grammar compiled) and how to answer."""

    chat: bool
    plans: list[Plan] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # of each token's entry


def decode_body(raw: bytes):
    """The JSON value of a request body; RequestError for what is not JSON,
    nests deeper than MAX_JSON_DEPTH, or holds a string that is not valid
    Unicode (named by its top-level field)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # (UnicodeDecodeError too)
        raise RequestError("the request body is not valid JSON") from None
    stack = [(value, 1, None)]
    while stack:  # iterative: a recursive walk is what deep JSON attacks
        item, depth, param = stack.pop()
        if isinstance(item, str):
            try:
                check_unicode(item, param or "request body")
            except ValueError as e:
                raise RequestError(str(e), param) from None
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param)
        for key, child in item.items() if isinstance(item, dict) else enumerate(item):
            name = param or (key if isinstance(key, str) else None)
            if isinstance(key, str):
                stack.append((key, depth, name))
            stack.append((child, depth + 1, name))
    return value


def _int(body: dict, name: str, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise RequestError(f"{name} must be >= {lo}, got {value}", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name)
    return value


def _sampler_fields(body: dict, runner: LLMRunner) -> dict:
    """The table's fields of the request, each checked as the runner checks it."""
    kwargs = {}
    for spec in SAMPLER_INPUTS:
        if spec.openai is None or spec.openai == "logit_bias" or body.get(spec.openai) is None:
            continue
        value = body[spec.openai]
        try:
            if spec.name == "seed":
                sampling_inputs(1, 1.0, seed=value)
            else:
                sampling_inputs(1, **{spec.name: value})
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), spec.openai) from None
        if spec.name in ROW_PARAMS and value == BY_NAME[spec.name].off:
            continue
        kwargs[spec.name] = value
    if not runner.samples:
        used = [BY_NAME[n].openai for n in kwargs if n != "seed" and not (n == "temperature" and kwargs[n] <= 0)]
        if used:
            raise RequestError(f"this program returns logits (exported with --no-sampling): only greedy "
                               f"decoding, not {used[0]}", used[0])
    return kwargs


def _logit_bias(body: dict, runner: LLMRunner) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object {token id: value}", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise RequestError(f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}", "logit_bias")
        out[token] = math.copysign(math.inf, value) if abs(value) == BIAS_LIMIT else float(value)
    if not out:
        return None
    if not runner.samples:
        raise RequestError("this program returns logits (exported with --no-sampling): no logit_bias",
                           "logit_bias")
    try:
        logit_bias_tensors(out, runner.input_shapes.get("logit_bias_ids", (1, 0))[1], runner.vocab_size)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e), "logit_bias") from None
    return out


def _tool_use(body: dict, runner: LLMRunner):
    """The request's tools (tool_calls.ToolUse), or None."""
    tools = body.get("tools")
    param = "tools" if tools is not None else "tool_choice"
    parallel = _optional_bool(body, "parallel_tool_calls", True)  # (its own RequestError, named by its field)
    try:
        use = runner.tool_use(tools, body.get("tool_choice"), parallel)
    except ValueError as e:
        message = str(e)
        raise RequestError(message, "tool_choice" if message.startswith("tool_choice") else param) from None
    if use is not None and use.grammar is not None and body.get("response_format") is not None:
        raise RequestError("response_format cannot be used with a required or named tool_choice (the call is "
                           "forced by a grammar of its own)", "response_format")
    return use


def _optional_bool(body: dict, name: str, default: bool) -> bool:
    return _bool(body, name) if body.get(name) is not None else default


def _prompt(body: dict, runner: LLMRunner, chat: bool, tools: list[dict] | None = None) -> list[int]:
    if chat:
        try:
            messages = check_messages(body.get("messages"))
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        if not runner.has_chat_template:
            raise RequestError("this model's tokenizer folder has no chat template: use /v1/completions",
                               "messages")
        ids = _tokenized(lambda: runner.chat_prompt(messages, tools=tools), "messages")
        name = "messages"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, str) and prompt:
            ids = _tokenized(lambda: runner.encode(prompt), "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in prompt):
            if not all(0 <= i < runner.vocab_size for i in prompt):
                raise RequestError(f"prompt token ids must be in [0, {runner.vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt; "
                               "batches are not implemented)", "prompt")
        name = "prompt"
    if not ids:
        raise RequestError(f"the {name} encode to no tokens", name)
    if len(ids) >= runner.max_context:
        raise RequestError(f"the {name} take {len(ids)} tokens; this model's context is {runner.max_context} "
                           f"tokens (room for at least one generated token is needed)", name,
                           "context_length_exceeded")
    return ids


def _tokenized(encode, param: str) -> list[int]:
    """encode()'s ids; its ValueError (a prompt that cannot fit the context,
    text that is not valid Unicode, a template's refusal) as a RequestError."""
    try:
        return encode()
    except ContextLengthError as e:
        raise RequestError(str(e), param, "context_length_exceeded") from None
    except ValueError as e:
        raise RequestError(str(e), param) from None


def parse(body, runner: LLMRunner, chat: bool, draft: dict | None = None) -> Request:
    """A request body -> the checked Request, its runner Plan prepared;
    RequestError for the first invalid field. `draft`: prepare()'s
    speculative-decoding keywords, for requests without a grammar (its
    mask is per position: those decode plainly, with the same output)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    n = _int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES}, got {n}", "n")
    request = Request(chat=chat)
    tool_use = _tool_use(body, runner) if chat else None
    prompt_ids = _prompt(body, runner, chat, tool_use and tool_use.tools)
    kwargs = _sampler_fields(body, runner)
    bias = _logit_bias(body, runner)
    if bias:
        kwargs["logit_bias"] = bias
    context = _int(body, "repetition_context_size", 1)
    if context is not None:
        kwargs["repetition_context_size"] = context
    history = runner.input_shapes.get("history", (1, 0))[1]
    if any(name in PENALTIES for name in kwargs):
        context = context or min(DEFAULT_REPETITION_CONTEXT, history)
        if context > history:
            raise RequestError(f"repetition_context_size {context} exceeds this program's history of {history} "
                               f"tokens", "repetition_context_size")
        kwargs["repetition_context_size"] = context
    try:
        kwargs["stop"] = check_stop(body.get("stop")) or None
    except ValueError as e:
        raise RequestError(str(e), "stop") from None
    # OpenAI's newer name first; the older one is still sent by many clients
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = runner.max_context - len(prompt_ids)
    limit = _int(body, limit_name, 1)
    if limit is not None and limit > room:
        raise RequestError(f"{limit_name} {limit} + the prompt's {len(prompt_ids)} tokens exceed this "
                           f"model's context of {runner.max_context} tokens", limit_name, "context_length_exceeded")
    kwargs["max_new_tokens"] = limit or room
    schema = _response_format(body)
    if schema is not None:
        kwargs["json_schema"] = schema
    request.logprobs, request.top_logprobs = _logprobs(body, runner, chat)
    request.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        request.include_usage = _bool(options, "include_usage")
    # OpenAI's defaults: temperature 1, and a different sample each time
    kwargs.setdefault("temperature", 1.0 if runner.samples else 0.0)
    kwargs.setdefault("seed", secrets.randbits(63))
    if tool_use is not None:
        kwargs["tool_use"] = tool_use
    if draft and schema is None and (tool_use is None or tool_use.grammar is None):
        kwargs.update(draft)
    try:  # every field is checked above: what prepare() refuses here is the grammar
        request.plans = [runner.prepare(prompt_ids, **{**kwargs, "seed": choice_seed(kwargs["seed"], i)})
                         for i in range(n)]
    except ValueError as e:
        field = "response_format" if schema is not None else "tools" if "tool_use" in kwargs else None
        raise RequestError(f"{field}: {e}" if field else str(e), field) from None
    return request


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a request seeded `seed` (choice 0: `seed` itself)."""
    return (seed + i * CHOICE_SEED_STEP) % 2**64


def _response_format(body: dict):
    """The JSON schema that `response_format` asks for (None: free text).
    {"type": "json_object"}: any JSON object; {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}: that schema, always enforced."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError('response_format json_schema must be an object with a "name" and a "schema"',
                               "response_format")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise RequestError("response_format json_schema.schema must be a JSON schema object", "response_format")
    else:
        raise RequestError('response_format type must be "text", "json_object" or "json_schema"', "response_format")
    return schema  # (compiled by the runner's prepare(), at the end of parse)


def _logprobs(body: dict, runner: LLMRunner, chat: bool) -> tuple[bool, int]:
    """(whether each token's logprob is wanted, how many top alternatives)."""
    if chat:
        wanted, name = _bool(body, "logprobs"), "top_logprobs"
        top = _int(body, name, 0) or 0
        if top and not wanted:
            raise RequestError("top_logprobs needs logprobs: true", name)
    else:  # the legacy field is the number of top logprobs; 0 gives the chosen token's only
        name = "logprobs"
        top = _int(body, name, 0)
        wanted, top = top is not None, top or 0
    if wanted and not runner.logprobs:
        raise RequestError("this program was exported without logprobs (executorch-mlx export --logprobs)",
                           "logprobs")
    available = runner.contract.top_logprobs
    if top > available:
        raise RequestError(f"{name} {top} exceeds the {available} this program returns (executorch-mlx export "
                           f"--top-logprobs K, at most 20)", name)
    return wanted, top
