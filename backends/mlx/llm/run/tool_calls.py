"""Tool calls: OpenAI's `tools` and `tool_choice` through a family's chat template.

    use = runner.tool_use(tools, "required")        # checked; the template's format
    result = runner.chat(messages, tools=tools, tool_choice="required")
    result.tool_calls  # [ToolCall(id, name, arguments)], arguments a JSON text

A model writes its calls in its family's format, which its chat template
shows it; the format is read off the template (TOOL_FORMATS):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen 2.5/3, Hermes, SmolLM3
    llama3   {"name": ..., "parameters": {...}} (after <|python_tag|>)  Llama 3.1-3.3
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}], or        Mistral, Ministral
             [TOOL_CALLS]name[ARGS]{...} where the template has [ARGS]
    harmony  <|channel|>commentary to=functions.NAME ...<|message|>{...}  gpt-oss

`tool_choice`: "auto" (the model decides; its answer is parsed), "none"
(the tools are shown, nothing is parsed), "required" or a named function:
those are forced by the token mask, a grammar of the family's call format
whose arguments are the function's JSON schema (grammar.py), so the
arguments always validate. The text before a call is the answer's content;
streamed, it stops at the first sign of a call (CallStart).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from .text_limits import prefix_tail

CHOICES = ("auto", "none", "required")
# the most tools one request may list (OpenAI's limit)
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls entry (with its index, in a streamed delta)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {name,
    description, parameters}}; ValueError naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {type: function, function: {name, parameters}}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools takes at most {MAX_TOOLS} functions, got {len(tools)}")
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is listed twice")
        seen.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"tools[{i}].function.description must be a string")
    return tools


def check_tool_choice(choice, tools: list[dict] | None) -> str:
    """The choice as a string: "auto", "none", "required", or the name of
    the function a named choice forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}")
        if choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs tools')
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    return name


def arguments_object(arguments, where: str) -> dict:
    """A call's arguments as the template takes them: an object (OpenAI
    sends a JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"{where} is not JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} must be a JSON object")
    return arguments


# ------------------------------------------------------------------ formats --
@dataclass(frozen=True)
class ToolFormat:
    """One family's way of writing calls: how they start (for streaming),
    their grammar (for forced calls) and how to read them back."""

    name: str
    starts: tuple[str, ...]  # the markers a call begins with
    leading_json: bool = False  # a call may also be bare JSON at the answer's start (llama3)
    args_marker: bool = False  # mistral's newer NAME[ARGS]{...}

    def grammar(self, tools: list[dict], forced: str, parallel: bool, token) -> str:
        """A Lark grammar (llguidance's) of calls to `forced` (a name, or
        "required": any of the tools); `token(text)` writes a marker as
        the grammar names it (special tokens by id)."""
        chosen = [t["function"] for t in tools if forced == "required" or t["function"]["name"] == forced]
        many = parallel and forced == "required"
        if self.name == "hermes":
            call = '<tool_call>'
            rules = [f'start: {token(call)} "\\n" call "\\n" {token("</tool_call>")}' +
                     (f' ("\\n" {token(call)} "\\n" call "\\n" {token("</tool_call>")})*' if many else ""),
                     f"call: %json {_json(_any([_call_schema(f, 'arguments') for f in chosen]))}"]
        elif self.name == "llama3":
            sep = ' ("; " call)*' if many else ""
            rules = [f"start: call{sep}", f"call: %json {_json(_any([_call_schema(f, 'parameters') for f in chosen]))}"]
        elif self.name == "mistral" and self.args_marker:
            alts = " | ".join(f'"{f["name"]}" {token("[ARGS]")} %json {_json(_params(f))}' for f in chosen)
            rules = [f"start: {token('[TOOL_CALLS]')} call" + (f" ({token('[TOOL_CALLS]')} call)*" if many else ""),
                     f"call: {alts}"]
        elif self.name == "mistral":
            items = {"type": "array", "items": _any([_call_schema(f, "arguments") for f in chosen]), "minItems": 1}
            if not many:
                items["maxItems"] = 1
            # (Mistral Small 3's template writes a space before the list; 7B v0.3's none)
            rules = [f"start: {token('[TOOL_CALLS]')} \" \"? %json {_json(items)}"]
        else:  # harmony: one call a message
            alts = " | ".join(f'"{f["name"]}" " " {token("<|constrain|>")} "json" {token("<|message|>")} '
                              f'%json {_json(_params(f))}' for f in chosen)
            rules = [f'start: {token("<|channel|>")} "commentary to=functions." call', f"call: {alts}"]
        return "\n".join(rules) + "\n"

    def parse(self, raw: str, new_id) -> list[ToolCall] | None:
        """The calls in `raw` (the answer with special tokens kept) from its
        first call on; None when there is none or one is not valid JSON."""
        found = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "harmony": _harmony}[self.name](raw)
        if not found:
            return None
        calls = []
        for name, arguments in found:
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(new_id(), name, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def call_id(self) -> str:
        """A new call's id (Mistral's templates take nine letters and digits)."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",)),
    "llama3": ToolFormat("llama3", ("<|python_tag|>",), leading_json=True),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",)),
    "mistral_args": ToolFormat("mistral", ("[TOOL_CALLS]",), args_marker=True),
    "harmony": ToolFormat("harmony", (" to=functions.", "to=functions.")),
}


def template_tool_format(source: str) -> ToolFormat | None:
    """The call format a chat template's text teaches (None: it shows no tools)."""
    if "tools" not in source:
        return None
    if "<tool_call>" in source:
        return TOOL_FORMATS["hermes"]
    if "[TOOL_CALLS]" in source:
        return TOOL_FORMATS["mistral_args" if "[ARGS]" in source else "mistral"]
    if "to=functions." in source or "<|call|>" in source:
        return TOOL_FORMATS["harmony"]
    if "<|python_tag|>" in source or '"parameters": dictionary' in source:
        return TOOL_FORMATS["llama3"]
    return None


def _json(schema) -> str:
    """A schema for llguidance's %json, compact like every JSON we constrain."""
    return json.dumps({**schema, "x-guidance": _COMPACT} if isinstance(schema, dict) else schema)


def _params(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def _call_schema(function: dict, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: _params(function)},
            "required": ["name", key], "additionalProperties": False}


def _any(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _objects(text: str, separators: str) -> list:
    """The JSON values in `text`, one after another (between them only
    whitespace and `separators`), a last None where something else is."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return values + [None]
        values.append(value)


def _one(text: str):
    """The one JSON value `text` holds, or None."""
    values = _objects(text, "")
    return values[0] if len(values) == 1 else None


def _call(value, key: str):
    """(name, arguments) of a call object, or None."""
    return (value.get("name"), value.get(key, value.get("arguments"))) if isinstance(value, dict) else None


def _whole(found: list) -> list | None:
    """The calls, each (name, arguments); a last one that did not parse (cut
    short by the token limit) is left out when calls before it did; None if
    another did not, or none did."""
    if found and found[-1] is None:
        found = found[:-1]
    return found if found and None not in found else None


def _hermes(raw: str):
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", raw, re.S)
    return _whole([_call(_one(b), "arguments") for b in blocks])


def _llama3(raw: str):
    text = raw.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in raw else raw
    return _whole([_call(v, "parameters") for v in _objects(text, ";")]) if text.strip().startswith("{") else None


def _mistral(raw: str):
    if "[TOOL_CALLS]" not in raw:
        return None
    rest = raw.split("[TOOL_CALLS]", 1)[1]
    if rest.lstrip().startswith("["):
        values = _one(rest)
        return _whole([_call(v, "arguments") for v in values]) if isinstance(values, list) else None
    found = []
    for part in rest.split("[TOOL_CALLS]"):
        name, marker, arguments = part.partition("[ARGS]")
        found.append((name.strip(), _one(arguments)) if marker and _one(arguments) is not None else None)
    return _whole(found)


def _harmony(raw: str):
    pattern = r"to=functions\.([^\s<]+)(.*?)<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)"
    found = []
    for match in re.finditer(pattern, raw, re.S):
        arguments = _one(match.group(3))
        found.append((match.group(1), arguments) if arguments is not None else None)
    return _whole(found)


# -------------------------------------------------------------- one request --
@dataclass
class ToolUse:
    """A request's tools, checked: what the template shows, what is forced,
    and how the answer is read."""

    tools: list[dict]
    choice: str  # auto, none, required, or a function's name
    format: ToolFormat
    parallel: bool = True
    grammar: str | None = None  # Lark text of the forced calls (required or named)
    special_ids: dict[str, int] = field(default_factory=dict)  # markers that are special tokens

    @classmethod
    def build(cls, tokenizer, form: ToolFormat, tools: list[dict], choice: str, parallel: bool) -> ToolUse:
        """For a `tokenizers.Tokenizer`: a forced choice's grammar names the
        format's markers that are added tokens by id (llguidance matches an
        added token only so), and the special ones start a call by id."""
        added = tokenizer.get_added_tokens_decoder()
        whole = {t.content: i for i, t in added.items()}
        special = {t.content: i for i, t in added.items() if t.special}

        def token(text: str) -> str:
            return f"<[{whole[text]}]>" if text in whole else json.dumps(text)

        grammar = form.grammar(tools, choice, parallel, token) if choice not in ("auto", "none") else None
        return cls(tools, choice, form, parallel, grammar, {m: special[m] for m in form.starts if m in special})

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def parse(self, raw: str) -> list[ToolCall] | None:
        return self.format.parse(raw, self.format.call_id) if self.parses else None

    def call_start(self) -> CallStart | None:
        """A fresh CallStart for one generation's streamed text."""
        if not self.parses:
            return None
        return CallStart([m for m in self.format.starts if m not in self.special_ids],
                         {self.special_ids[m] for m in self.format.starts if m in self.special_ids},
                         self.format.leading_json)


class CallStart:
    """Where a call begins in the streamed text (the text with special
    tokens skipped), so that nothing of it is streamed as content: at a
    text marker, at a special marker token (`see`), or, for llama3, at JSON
    opening the answer. Until the answer shows more than whitespace, or
    while its end could begin a marker, the text is held back."""

    def __init__(self, markers: list[str], ids: set[int], leading_json: bool):
        self.markers, self.ids, self.leading_json = markers, ids, leading_json
        self.at: int | None = None  # where a special marker token came
        self.released = False  # no call after all: stream everything

    def see(self, token: int, text_before: str) -> None:
        if token in self.ids and self.at is None:
            self.at = len(text_before)

    def hold(self, text: str, final: bool) -> int:
        """The end of what may be streamed of `text` now."""
        if self.released:
            return len(text)
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if self.at is not None:
            found.append(self.at)
        lead = len(text) - len(text.lstrip())
        if self.leading_json and text[lead:lead + 1] == "{":
            found.append(lead)
        if found:  # (whitespace before a call is not content)
            return min(found) if text[:min(found)].strip() else 0
        if final:
            return len(text)
        if not text.strip():
            return 0
        return len(text) - prefix_tail(text, self.markers)
