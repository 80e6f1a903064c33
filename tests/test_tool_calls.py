"""Issue 38 item 4 (tool calls), without a model: each family's format is
read off its template, its forced-call grammar accepts exactly the call its
parser reads back (token by token, through llguidance with a tokenizer that
has the family's special tokens), the streamed text stops where a call
begins, and bad tools are refused by name. The server and a model:
test_serve.py."""

from __future__ import annotations

import json

import pytest

from executorch_mlx.llm.model_folders import CHAT_TOKENS, CHATML, TOOL_TEXT, TOOL_TOKENS, train_tokenizer
from executorch_mlx.llm.run.channels import FinalChannel
from executorch_mlx.llm.run.decode_parts import TextOut
from executorch_mlx.llm.run.grammar import TokenConstraint, grammar_tokenizer
from executorch_mlx.llm.run.tool_calls import (TOOL_FORMATS, ToolUse, check_tool_choice, check_tools,
                                               template_tool_format)

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
SPECIALS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>",
            "<|start|>", "<|end|>", "<|return|>"]
ARGS = {"city": "Paris", "days": 3}
# each family's template, as far as the format is read off it (pieces of the real ones)
TEMPLATES = {
    "hermes": CHATML,
    "llama3": '{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
              'name and its value}.{{ "<|python_tag|>" }}{% endif %}',
    "mistral": '{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]',
    "mistral_args": '{%- if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}',
    "harmony": '{%- if tools %}namespace functions {% endif %}<|start|>assistant to=functions.{{ name }}<|call|>',
}
# the call each format writes (special tokens spelled out)
CALLS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":3}}\n</tool_call>',
    "llama3": '{"name":"get_weather","parameters":{"city":"Paris","days":3}}',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":3}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","days":3}',
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}',
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(extra_text=TOOL_TEXT + " commentary to=functions. json get_weather Paris")
    tok.add_special_tokens(list(CHAT_TOKENS) + SPECIALS)
    tok.add_tokens(list(TOOL_TOKENS))
    return tok


def _use(tokenizer, key: str, choice: str = "required", parallel: bool = True) -> ToolUse:
    """ToolUse as LLMRunner.tool_use builds it for a template of format `key`."""
    return ToolUse.build(tokenizer, TOOL_FORMATS[key], TOOLS, choice, parallel)


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_the_format_is_read_off_the_template(key):
    assert template_tool_format(TEMPLATES[key]) == TOOL_FORMATS[key]


def test_a_template_without_tools_has_no_format():
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    assert template_tool_format(plain) is None
    assert template_tool_format("{% if tools %}{{ tools | tojson }}{% endif %}") is None  # shows tools, no format


@pytest.mark.parametrize("key", sorted(CALLS))
def test_the_forced_grammar_accepts_the_call_the_parser_reads(tokenizer, key):
    use = _use(tokenizer, key, "get_weather")
    eos = {tokenizer.token_to_id("</s>")}
    constraint = TokenConstraint(use.grammar, grammar_tokenizer(tokenizer, tokenizer.get_vocab_size(), eos), eos)
    ids = tokenizer.encode(CALLS[key], add_special_tokens=False).ids
    for token in ids:
        constraint.advance(token)  # GrammarError if the grammar refused it
    assert constraint.matcher.is_accepting()
    assert tokenizer.decode(ids, skip_special_tokens=False) == CALLS[key]
    [call] = use.parse(CALLS[key])
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS


@pytest.mark.parametrize("key", sorted(CALLS))
def test_the_forced_grammar_refuses_another_function_and_bad_arguments(tokenizer, key):
    use = _use(tokenizer, key, "add")  # a named choice: get_weather is not allowed
    eos = {tokenizer.token_to_id("</s>")}
    constraint = TokenConstraint(use.grammar, grammar_tokenizer(tokenizer, tokenizer.get_vocab_size(), eos), eos)
    ids = tokenizer.encode(CALLS[key], add_special_tokens=False).ids
    with pytest.raises(ValueError, match="refused"):
        for token in ids:
            constraint.advance(token)


def test_parallel_calls_and_what_is_not_a_call():
    hermes = TOOL_FORMATS["hermes"]
    two = CALLS["hermes"] + "\n" + CALLS["hermes"].replace("get_weather", "add")
    assert [c.name for c in hermes.parse(two, hermes.call_id)] == ["get_weather", "add"]
    assert hermes.parse("no call here", hermes.call_id) is None
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'  # by the token limit
    assert hermes.parse(cut, hermes.call_id) is None
    assert [c.name for c in hermes.parse(CALLS["hermes"] + "\n" + cut, hermes.call_id)] == ["get_weather"]
    broken = '<tool_call>\n{"name": "add", "arguments": [}\n</tool_call>\n'
    assert hermes.parse(broken + CALLS["hermes"], hermes.call_id) is None  # a broken call that is not the last
    llama = TOOL_FORMATS["llama3"]
    calls = llama.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
                        llama.call_id)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"x": 1})]
    assert llama.parse("The answer is {not json", llama.call_id) is None
    mistral = TOOL_FORMATS["mistral"]
    [call] = mistral.parse(CALLS["mistral"].replace("[{", " [{"), mistral.call_id)
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates take nine letters and digits
    harmony = TOOL_FORMATS["harmony"]
    [call] = harmony.parse(CALLS["harmony"] + "<|call|>", harmony.call_id)
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS


def _stream(tokenizer, use: ToolUse | None, text: str, channels=None) -> tuple[list[str], TextOut]:
    """TextOut fed `text`'s tokens one at a time, as a decode loop feeds it."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = []
    out = TextOut(tokenizer, [], pieces.append, tool_use=use, channels=channels)
    for n in range(1, len(ids) + 1):
        out.update(ids[:n])
    out.update(ids, final=True)
    return pieces, out


@pytest.mark.parametrize("key", ["hermes", "mistral", "llama3"])
def test_streamed_content_stops_where_a_call_begins(tokenizer, key):
    lead = "" if key == "llama3" else "The fox ran.\n"  # (a Llama 3 call is the whole answer)
    pieces, out = _stream(tokenizer, _use(tokenizer, key, "auto"), lead + CALLS[key])
    assert "".join(pieces) == lead == out.result([])
    [call] = out.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS


def test_text_that_only_looked_like_a_call_is_streamed_whole(tokenizer):
    text = "The fox <tool_call> ran"
    pieces, out = _stream(tokenizer, _use(tokenizer, "hermes", "auto"), text)
    assert "".join(pieces) == text and out.tool_calls is None
    pieces, out = _stream(tokenizer, _use(tokenizer, "hermes", "none"), "The fox.\n" + CALLS["hermes"])
    assert out.tool_calls is None  # tool_choice none: nothing is parsed


@pytest.mark.parametrize("tools, message", [
    ([], "non-empty list"),
    ([{"type": "function"}], "tools\\[0\\] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "a"}}] * 2, "listed twice"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], "JSON schema object"),
])
def test_bad_tools_are_refused_by_name(tools, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools)


def test_tool_choice():
    assert check_tool_choice(None, TOOLS) == "auto"
    assert check_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) == "add"
    with pytest.raises(ValueError, match="not in tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(ValueError, match="one of auto, none, required"):
        check_tool_choice("always", TOOLS)


def test_gpt_oss_content_is_its_final_channel(tokenizer):
    """Harmony's channel names never reach the text; its calls are read from
    the commentary channel."""
    channels = lambda: FinalChannel.of(TEMPLATES["harmony"] + "<|channel|>", tokenizer)  # noqa: E731
    answer = ("<|channel|>analysis<|message|>The fox ran.<|end|><|start|>assistant<|channel|>final<|message|>"
              "The sun rose.<|return|>")
    pieces, out = _stream(tokenizer, None, answer, channels())
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    assert "".join(pieces) == "The sun rose." == out.result(ids)
    assert TextOut(tokenizer, [], None, channels=channels()).result(ids) == "The sun rose."  # not streamed
    called = "<|channel|>analysis<|message|>The fox ran.<|end|><|start|>assistant" + CALLS["harmony"] + "<|call|>"
    pieces, out = _stream(tokenizer, _use(tokenizer, "harmony", "auto"), called, channels())
    [call] = out.tool_calls
    assert "".join(pieces) == "" and call.name == "get_weather" and json.loads(call.arguments) == ARGS
    assert FinalChannel.of(CHATML, tokenizer) is None  # a template without channels
