"""OpenAI's Responses API (POST /v1/responses) on the chat completions path.

A Responses request is translated into the chat request it means
(`instructions` and `input` -> messages, `max_output_tokens` ->
max_completion_tokens, `text.format` -> response_format, `include`'s
output logprobs -> logprobs, function `tools` and `tool_choice` -> chat's,
`function_call` and `function_call_output` items -> an assistant's
tool_calls and tool messages), which requests.parse checks and the runner
runs as any chat request; errors name the Responses field. The answer is a
Response object (a message, then a function_call item per call), or the
Responses stream of events. Refused by name, not built yet: tools other
than functions, stored conversations (`previous_response_id`,
`conversation`: this server stores nothing), input other than text.
"""

from __future__ import annotations

import json
import uuid

from ..serialization.sampler_params import SAMPLER_INPUTS
from .requests import RequestError

# chat field -> the Responses field it came from (for error messages)
RESPONSES_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                    "logprobs": "include"}
# passed through as they are: the sampler table's OpenAI names and our own extras
PASSED = {s.openai for s in SAMPLER_INPUTS if s.openai} | {"stream", "repetition_context_size", "top_logprobs",
                                                           "parallel_tool_calls"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


def chat_body(body) -> dict:
    """The chat completions body a Responses body means; RequestError
    (naming the Responses field) for what it cannot be."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise RequestError(f"{name} is not implemented: this server stores no responses; send the whole "
                               f"conversation as input", name)
    chat = {name: value for name, value in body.items() if name in PASSED}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # the Responses API names it flat
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    chat["messages"] = messages + _messages(body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise RequestError("include must be a list of strings", "include")
        chat["logprobs"] = LOGPROBS_INCLUDE in include
    if body.get("top_logprobs"):  # (asking for the top ones asks for the logprobs)
        chat["logprobs"] = True
    return chat


def _tools(tools) -> list[dict]:
    """Responses function tools {type, name, description, parameters} as chat's."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{i}]: only function tools are implemented, got {kind!r}", "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def _function_item(item: dict, i: int) -> dict:
    """A function_call item (a call the model made) or a function_call_output (its result) as chat's message."""
    if not isinstance(item.get("call_id"), str):
        raise RequestError(f"input[{i}].call_id must be a string", "input")
    if item["type"] == "function_call_output":
        if not isinstance(item.get("output"), str):
            raise RequestError(f"input[{i}].output must be a string", "input")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
        raise RequestError(f"input[{i}] must have a name and arguments (a JSON text)", "input")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": item["call_id"], "type": "function", "function": function}]}


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of messages", "input")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be a message object", "input")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            message = _function_item(item, i)
            last = messages[-1] if messages else {}
            if message["role"] == "assistant" and last.get("role") == "assistant":
                last["tool_calls"] = last.get("tool_calls", []) + message["tool_calls"]  # calls of one turn
            else:
                messages.append(message)
            continue
        if kind != "message":
            raise RequestError(f"input[{i}]: items of type {kind!r} are not implemented (text messages and "
                               f"function calls only)", "input")
        role = ROLES.get(item.get("role"))
        if role is None:
            raise RequestError(f"input[{i}].role must be one of {', '.join(ROLES)}, got {item.get('role')!r}",
                               "input")
        content = item.get("content")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") in TEXT_PARTS else None
                     for p in content]
            if not all(isinstance(p, str) for p in parts):
                raise RequestError(f"input[{i}].content: only {' and '.join(TEXT_PARTS)} parts with a text are "
                                   f"implemented", "input")
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"input[{i}].content must be a string or a list of text parts", "input")
        messages.append({"role": role, "content": content})
    return messages


def _text_format(text) -> dict | None:
    """`text.format` as chat's response_format (None: free text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if isinstance(text, dict):
            return None
        raise RequestError("text must be an object with a format", "text")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise RequestError('text.format type must be "text", "json_object" or "json_schema"', "text")


class ResponseBuilder:
    """A Response object for one request, whole or as a stream of events."""

    def __init__(self, ids: tuple[str, str], created: int, model: str, body: dict):
        (self.id, self.message_id), self.created, self.model, self.body = ids, created, model, body
        self.sequence = 0

    def response(self, status: str, text: str | None = None, logprobs: list | None = None,
                 usage: dict | None = None, calls=()) -> dict:
        """The Response object: its message of `text` (None: no message, as
        while nothing is out yet, or for an answer that is calls only), then each call."""
        body = self.body
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        output = [] if text is None else [self.message(text, status, logprobs)]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output + [self.function_call(call) for call in calls],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": fmt or {"type": "text"}}, "store": False, "metadata": body.get("metadata") or {},
            "usage": usage,
        }

    def message(self, text: str, status: str, logprobs: list | None) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.part(text, logprobs)]}

    def function_call(self, call, status: str = "completed") -> dict:
        """A call (tool_calls.ToolCall) as a function_call item, its id derived from the call's."""
        return {"type": "function_call", "id": f"fc_{uuid.uuid5(uuid.NAMESPACE_OID, call.id).hex[:24]}",
                "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": status}

    @staticmethod
    def part(text: str, logprobs: list | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def event(self, kind: str, **fields) -> str:
        """One server-sent event of the stream, numbered in order."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        """The events before anything is out: the response."""
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def message_opening(self) -> list[str]:
        """The events before the first text: the message, its text part
        (not sent for an answer that is calls only)."""
        return [self.event("response.output_item.added", output_index=0,
                           item={**self.message("", "in_progress", None), "content": []}),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part=self.part("", None))]

    def delta(self, piece: str, logprobs: list) -> str:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=piece, logprobs=logprobs)

    def closing(self, status: str, text: str, logprobs: list, usage: dict, calls=(), opened: bool = True) -> list[str]:
        """The events after the last text (the message's, if `opened`; it is
        opened now if it was not and there are no calls), each call's, then
        response.completed (or .incomplete)."""
        where = dict(item_id=self.message_id, output_index=0, content_index=0)
        end = "response.completed" if status == "completed" else "response.incomplete"
        events = [] if opened or calls else self.message_opening()
        if opened or not calls:
            events += [self.event("response.output_text.done", **where, text=text, logprobs=logprobs),
                       self.event("response.content_part.done", **where, part=self.part(text, logprobs)),
                       self.event("response.output_item.done", output_index=0,
                                  item=self.message(text, status, logprobs))]
        first = 1 if opened or not calls else 0
        for index, call in enumerate(calls, first):
            item = self.function_call(call)
            events += [self.event("response.output_item.added", output_index=index,
                                  item={**self.function_call(call, "in_progress"), "arguments": ""}),
                       self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments),
                       self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=call.arguments),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events + [self.event(end, response=self.response(status, text if first else None, logprobs, usage,
                                                                calls))]


def response_usage(usage: dict) -> dict:
    """Chat completions' usage in the Responses API's names."""
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}
