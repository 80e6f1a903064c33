"""What a model folder says about conversations: its chat template and its
end-of-generation ids; and stop strings cut from streamed text.

    if has_chat_template("model_dir"):
        text = ChatTemplate("model_dir").render([{"role": "user", "content": "Hi"}])
    eos = end_of_generation_ids("model_dir", tokenizer)

The template is the one transformers' tokenizer loads (chat_template.jinja
and additional_chat_templates/*.jinja, else `tokenizer_config.json`'s
`chat_template`), rendered by transformers' own renderer (its sandbox,
filters and globals) with the special tokens the folder names, as
`apply_chat_template` renders it: a prompt is exactly the text transformers
would build. The tokenizer classes behind `apply_chat_template` import
torch (5-9 s before a first token); the renderer alone does not (about 1 s).
Only a template that shows a special token the folder does not name (which
the tokenizer class may give a default) is rendered by the tokenizer itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .text_limits import check_unicode, prefix_tail
from .tool_calls import arguments_object

ROLES = ("system", "user", "assistant", "developer", "tool")
# Stop strings are searched in the text after every token: their number and
# length bound that work (OpenAI's API takes 4).
MAX_STOPS = 16
MAX_STOP_CHARS = 256


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def has_chat_template(folder: str | Path) -> bool:
    return bool(chat_templates(folder))


def chat_templates(folder: str | Path) -> dict[str, str]:
    """A folder's chat templates by name ("default", "tool_use", ...), read
    as transformers' tokenizer reads them: the template files, when there
    are any, replace `tokenizer_config.json`'s `chat_template` (a string:
    the default, or a list of named ones); {} for none."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    files = {}
    for path in [folder / "chat_template.jinja", *sorted((folder / "additional_chat_templates").glob("*.jinja"))]:
        try:
            name = "default" if path.parent == folder else path.name.removesuffix(".jinja")
            files[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass
    if files:
        return files
    template = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def template_source(folder: str | Path) -> str:
    """The text of all of a folder's chat templates ("" for none): what the
    runner reads a tool-call format and a final channel from."""
    return "\n".join(chat_templates(folder).values())


# The special tokens a template sees by name (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens(folder: str | Path) -> dict[str, str | None]:
    """The special tokens `tokenizer_config.json` names (a string, an
    {"content": ...} object or null each), with a legacy
    special_tokens_map.json's over them where the config has no
    added_tokens_decoder, as transformers reads them."""
    folder = Path(folder)
    config = _json(folder / "tokenizer_config.json")
    values = {name: config[name] for name in SPECIAL_TOKENS if name in config}
    if "added_tokens_decoder" not in config:
        values.update({name: value for name, value in _json(folder / "special_tokens_map.json").items()
                       if name in SPECIAL_TOKENS})
    texts = {name: value.get("content") if isinstance(value, dict) else value for name, value in values.items()}
    return {name: text if isinstance(text, str) else None for name, text in texts.items()}


def check_messages(messages) -> list[dict]:
    """The messages as the template takes them: a non-empty list of {role,
    content}; content a string or OpenAI's list of text parts (joined). An
    assistant's `tool_calls` (their arguments as objects, as templates take
    them) and a tool message's `tool_call_id` and `name` are kept.
    ValueError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content, **_tool_fields(m, f"messages[{i}]")})
    return out


def _tool_fields(message: dict, where: str) -> dict:
    fields = {}
    calls = message.get("tool_calls")
    if calls is not None and message["role"] == "assistant":
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        fields["tool_calls"] = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where}.tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}")
            arguments = arguments_object(function.get("arguments", "{}"), f"{where}.tool_calls[{j}].function.arguments")
            fields["tool_calls"].append({"id": str(call.get("id", "")), "type": "function",
                                         "function": {"name": function["name"], "arguments": arguments}})
    if message["role"] == "tool":
        for name in ("tool_call_id", "name"):
            if message.get(name) is not None:
                if not isinstance(message[name], str):
                    raise ValueError(f"{where}.{name} must be a string")
                fields[name] = message[name]
    return fields


class ChatTemplate:
    """A folder's chat template (see the module's docstring)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.templates = chat_templates(self.folder)
        if not self.templates:
            raise ValueError(f"{self.folder} has no chat template")
        self.special_tokens = special_tokens(self.folder)
        self._transformers_tokenizer = None  # loaded only for a special token the folder does not name

    def render(self, messages: list[dict], system_prompt: str | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text of `messages` (checked), ending with the assistant's
        turn opened; `system_prompt` goes first unless a system message is
        there; `tools` (checked: tool_calls.check_tools) as the template shows them."""
        from transformers.utils.chat_template_utils import render_jinja_template

        messages = check_messages(messages)
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        # apply_chat_template's choice: "tool_use" when there are tools and a template of that name
        template = self.templates.get("tool_use") if tools is not None else None
        template = template or self.templates.get("default")
        if template is None:
            raise ValueError(f"{self.folder} has chat templates {sorted(self.templates)} but no default one")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as apply_chat_template
        # A special token the template shows but the folder does not name may
        # have a default in the tokenizer class transformers picks: only
        # transformers' tokenizer knows it (and imports torch).
        unnamed = [n for n in SPECIAL_TOKENS if n not in self.special_tokens and re.search(rf"\b{n}\b", template)]
        try:
            if unnamed:
                return self._tokenizer().apply_chat_template(messages, tools=tools, tokenize=False,
                                                             add_generation_prompt=True)
            tokens = {name: text for name, text in self.special_tokens.items() if text is not None}
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                                add_generation_prompt=True, **tokens)
        except Exception as e:  # jinja raises its own errors (raise_exception in templates)
            raise ValueError(f"the chat template of {self.folder} refused these messages: {e}") from None
        return rendered[0]

    def _tokenizer(self):
        if self._transformers_tokenizer is None:
            from transformers import AutoTokenizer

            self._transformers_tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
        return self._transformers_tokenizer


def end_of_generation_ids(folder: str | Path, tokenizer=None) -> set[int]:
    """Every eos id the folder names: generation_config.json's and
    config.json's `eos_token_id` (an int or a list), and the tokenizer's eos token."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        eos = _json(folder / name).get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and not isinstance(e, bool):
                ids.add(e)
    token = _json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # an AddedToken's fields
        token = token.get("content")
    if isinstance(token, str) and tokenizer is not None:
        i = tokenizer.token_to_id(token)
        if i is not None:
            ids.add(i)
    return ids


def check_stop(stop) -> list[str]:
    """OpenAI's `stop`: None, a string, or a list of strings (non-empty each),
    at most MAX_STOPS of at most MAX_STOP_CHARS characters."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {_short(stop)}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters, stop[{i}] has {len(s)}")
        check_unicode(s, f"stop[{i}]")
    return list(stops)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class StopText:
    """Text as it grows, emitted so that no stop string is ever shown: the
    tail that could still begin one is held back until it cannot. A stop
    string may span tokens; once one appears the text ends before it.
    `hold(text, final)`, if given, is the end of what may be emitted yet
    (tool_calls.CallStart: nothing of a call)."""

    def __init__(self, stops: list[str], hold=None):
        self.stops, self.hold = stops, hold
        self.emitted = ""
        self.stopped = False

    def update(self, text: str, final: bool = False) -> str:
        """`text` is the whole text so far (each call extends the last);
        returns the new piece to emit. Sets `stopped` on a stop string."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(text)
        else:
            end = len(text) - prefix_tail(text, self.stops)
        if self.hold is not None:
            end = min(end, self.hold(text, final))
        piece = text[len(self.emitted):end] if end > len(self.emitted) else ""
        self.emitted += piece
        return piece

