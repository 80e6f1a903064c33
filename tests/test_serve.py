"""Issue 18 (chat and serve): chat templates, stop strings, multi-turn with
the KV cache reused, `executorch-mlx chat` in a pseudo-terminal, and the
OpenAI-compatible server driven by the official `openai` client.

One tiny Qwen2 instruct folder (ChatML template, `<|im_end|>` an eos id of
generation_config.json only) is exported once; one server, started from the
README's own command line on a free port of 127.0.0.1, serves every server
test and is stopped at the end. Greedy answers are held to transformers'
greedy generation under the same chat template."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from executorch_mlx.llm.run.chat import StopText
from executorch_mlx.llm.model_folders import CHAT_TOKENS
from llm_programs import SERVE_CONTEXT, chat_program
from test_documented_commands import README, runnable

MAX_CONTEXT = SERVE_CONTEXT  # (room for the tools the template lists)
HELLO = [{"role": "user", "content": "Once upon a time"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD}}]


@dataclass
class Model:
    root: Path
    folder: Path
    pte: Path
    server: subprocess.Popen
    port: int
    log: object
    chat: object


@pytest.fixture(scope="module")
def model(shared, tmp_path_factory):
    """The README's names: MODEL_DIR (a chat folder) and model.pte (with
    logprobs). The server and the terminal chat start as soon as the program
    is there, so that they load while the first tests run."""
    import pexpect

    folder, pte = chat_program(shared, MAX_CONTEXT, tools=True)
    root = pte.parent
    port = _free_port()
    [line] = runnable(README, "serve")  # the README's serve line, run where model.pte and MODEL_DIR are
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    server = subprocess.Popen(["bash", "-c", "exec " + _shell(line, port)], cwd=root, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    chat = pexpect.spawn(sys.executable, ["-m", "executorch_mlx.cli", "chat", str(pte), "--tokenizer", str(folder),
                                          "--max-new-tokens", "16"], encoding="utf-8", timeout=90)
    yield Model(root, folder, pte, server, port, log, chat)
    chat.close(force=True)
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def reference(model):
    """transformers' greedy generation under the folder's chat template."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model.folder
    tok = AutoTokenizer.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()

    def prompt(messages, tools=None) -> list[int]:
        # transformers' template, encoded by tokenizer.json as the server encodes it (for a qwen2 folder
        # transformers puts Qwen's own pre-tokenizer in front, which splits digits apart)
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids

    def greedy(messages=None, n: int = 16, ids: list[int] | None = None, **kw) -> tuple[list[int], str]:
        if ids is None:
            ids = prompt(messages)
        with torch.no_grad():
            out = lm.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, **kw)[0, len(ids):].tolist()
        return out, tok.decode(out, skip_special_tokens=True)

    greedy.tokenizer, greedy.prompt = tok, prompt
    return greedy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shell(line: str, port: int) -> str:
    """A README line with its port made this test's."""
    return line.replace("8080", str(port))


def wait_until_serving(port: int, process: subprocess.Popen, log) -> None:
    """Returns once the server on `port` answers /health; fails with its log
    if it exits or does not start within 2 minutes."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                assert json.load(r) == {"status": "ok"}
            return
        except OSError:
            log.seek(0)
            assert process.poll() is None, f"the server exited: {log.read()}"
            assert time.monotonic() < deadline, f"the server did not start: {log.read()}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server(model):
    """The base URL and port of the README's server, once it answers."""
    wait_until_serving(model.port, model.server, model.log)
    return f"http://127.0.0.1:{model.port}", model.port


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server[0] + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _chat(client, messages=HELLO, **kw):
    return client.chat.completions.create(model="model", messages=messages, **kw)


def _streamed(client, messages=HELLO, **kw) -> tuple[str, str, list]:
    """(joined content, finish reason, logprob entries) of a streamed chat."""
    text, finish, logprobs = [], None, []
    for chunk in _chat(client, messages, stream=True, **kw):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            if choice.logprobs and choice.logprobs.content:
                logprobs += [(e.token, e.logprob) for e in choice.logprobs.content]
    return "".join(text), finish, logprobs


# ------------------------------------------------------------- stop text --
def test_stop_strings_are_held_back_across_pieces():
    stop = StopText(["<end>", "xyz"])
    pieces = [stop.update(t) for t in ("ab<", "ab<e", "ab<en", "ab<en!x")]
    assert pieces == ["ab", "", "", "<en!"] and not stop.stopped  # "<en!" can begin no stop string
    assert stop.update("ab<en!xy") == "" and stop.update("ab<en!xyz tail") == "" and stop.stopped
    assert stop.emitted == "ab<en!"
    done = StopText(["<end>"])
    assert done.update("a<e") == "a" and done.update("a<e", final=True) == "<e"  # the end flushes what waits


# ------------------------------------------------- generate and chat (CLI) --
def test_generate_applies_the_chat_template_by_default(model, reference, capsys):
    from executorch_mlx.cli import main

    folder, pte = model.folder, model.pte
    args = ["generate", str(pte), "--tokenizer", str(folder), "--prompt", HELLO[0]["content"],
            "--max-new-tokens", "16", "--json"]
    assert main(args) == 0
    want, _ = reference(HELLO)
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main(args + ["--ignore-chat-template"]) == 0  # the raw prompt: another answer
    raw = reference.tokenizer(HELLO[0]["content"])["input_ids"]
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference(ids=raw)[0]
    assert main(args + ["--system-prompt", "The fox"]) == 0
    with_system, _ = reference([{"role": "system", "content": "The fox"}] + HELLO)
    assert json.loads(capsys.readouterr().out)["token_ids"] == with_system


def test_chat_in_a_terminal(model, reference):
    """Streamed answers, multi-turn with the cache reused, /reset and /exit."""
    import pexpect

    want, text = reference(HELLO)
    chat = model.chat  # started by the fixture
    try:
        chat.expect_exact("> ")
        chat.sendline(HELLO[0]["content"])
        chat.expect(r"\[(\d+) tokens, [\d.]+ tokens/s; (\d+) of (\d+) prompt tokens reused\]")
        assert chat.before.replace("\r\n", "\n").strip().endswith(text.strip())
        assert int(chat.match.group(1)) == len(want) and chat.match.group(2) == "0"
        chat.expect_exact("> ")
        chat.sendline("The fox")
        chat.expect(r"(\d+) of (\d+) prompt tokens reused\]")
        assert int(chat.match.group(1)) > int(chat.match.group(2)) // 2  # the first turn was not prefilled again
        chat.expect_exact("> ")
        chat.sendline("/reset")
        chat.expect_exact("(a new conversation)")
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0


# ---------------------------------------------------------------- server --
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["model"]


def test_greedy_chat_equals_transformers(client, reference):
    want, text = reference(HELLO)
    reply = _chat(client, temperature=0, max_tokens=16, extra_body={"an_unknown_field": [1]})  # ignored
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == len(want)
    eos = {1, reference.tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])}
    assert reply.choices[0].finish_reason == ("stop" if want[-1] in eos else "length")
    prompt = reference.prompt(HELLO)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.total_tokens == len(prompt) + len(want)


def test_stream_equals_whole(client):
    for kw in (dict(temperature=0), dict(temperature=1.1, seed=5, top_p=0.9, logprobs=True),
               dict(temperature=1.3, seed=9, stop=["e", "o"], extra_body={"top_k": 20, "min_p": 0.01})):
        whole = _chat(client, max_tokens=24, **kw)
        text, finish, logprobs = _streamed(client, max_tokens=24, **kw)
        assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
        if kw.get("logprobs"):
            assert logprobs == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_response_format_json_schema_is_enforced_streamed_or_not(client):
    """The schema's mask is applied in the program's sampler (this tiny
    tokenizer spells no braces or quotes: a boolean schema, letters only)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {"type": "boolean"}, "strict": True}}
    for seed in range(3):
        whole = _chat(client, temperature=1.0, seed=seed, max_tokens=16, response_format=fmt)
        assert json.loads(whole.choices[0].message.content) in (True, False)
        assert whole.choices[0].finish_reason == "stop"
        text, finish, _ = _streamed(client, temperature=1.0, seed=seed, max_tokens=16, response_format=fmt)
        assert (text, finish) == (whole.choices[0].message.content, "stop")


def test_seeded_sampling_is_reproducible(client):
    runs = [_chat(client, temperature=1.2, seed=s, max_tokens=24).choices[0].message.content for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    penalized = dict(temperature=1.0, seed=3, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.3,
                     extra_body={"repetition_penalty": 1.3, "repetition_context_size": 32})
    twice = [_chat(client, **penalized).choices[0].message.content for _ in range(2)]
    assert twice[0] == twice[1]


def test_logit_bias_bans_and_forces_tokens(client, reference):
    want, _ = reference(HELLO)
    banned = sorted(set(want[:6]) - {1, 230})
    reply = _chat(client, temperature=0, max_tokens=16, logprobs=True, logit_bias={str(t): -100 for t in banned})
    tokens = [e.token for e in reply.choices[0].logprobs.content]
    assert tokens and not {reference.tokenizer.decode([t]) for t in banned} & set(tokens)
    # +100 forces <|im_end|>, an eos id of generation_config.json only: the answer ends at once
    end = reference.tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])
    forced = _chat(client, temperature=0.7, seed=1, max_tokens=16, logit_bias={str(end): 100})
    assert forced.choices[0].message.content == "" and forced.choices[0].finish_reason == "stop"
    assert forced.usage.completion_tokens == 1


def test_stop_strings_cut_across_tokens(client, reference):
    want, text = reference(HELLO)
    tok = reference.tokenizer
    pieces = [tok.decode([t]) for t in want]
    i = next(k for k in range(1, len(pieces)) if pieces[k - 1] and pieces[k])
    stop = pieces[i - 1][-1] + pieces[i][0]  # spans two tokens
    cut = text[:text.find(stop)]
    for stream in (False, True):
        if stream:
            got, finish, _ = _streamed(client, temperature=0, max_tokens=16, stop=[stop, "never seen"])
        else:
            reply = _chat(client, temperature=0, max_tokens=16, stop=stop)
            got, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (got, finish) == (cut, "stop")


def test_logprobs(client, server, reference):
    reply = _chat(client, temperature=0, max_tokens=12, logprobs=True)
    entries = reply.choices[0].logprobs.content
    vocab = len(reference.tokenizer)
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    assert all(-torch.log(torch.tensor(float(vocab))) <= e.logprob <= 0 for e in entries)  # greedy: the top token
    assert all(bytes(e.bytes) == e.token.encode() for e in entries)
    status, body = _post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6,
                                                     "temperature": 0.9, "seed": 2, "logprobs": 0})
    logprobs = body["choices"][0]["logprobs"]
    assert status == 200 and "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"])
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["text_offset"][0] == 0


def test_top_logprobs_are_the_raw_distributions_most_likely(model, reference):
    """The program returns each step's 5 most likely tokens under log_softmax
    of the raw logits: transformers' top 5 on the same tokens, sorted, and
    the chosen token's logprob among them where it is one of them."""
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.run.runner import LLMRunner

    ids = reference.prompt(HELLO)
    result = LLMRunner(model.pte, model.folder).generate(ids, max_new_tokens=8, temperature=1.0, seed=4)
    lm = AutoModelForCausalLM.from_pretrained(model.folder).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([ids + result.token_ids])).logits[0, len(ids) - 1:-1]
    want = torch.topk(torch.log_softmax(logits.float(), -1), 5)
    for step, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        ids_, values = zip(*lp.top)
        assert list(ids_) == want.indices[step].tolist() and list(values) == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), want.values[step], atol=1e-4, rtol=1e-4)
        assert dict(lp.top).get(token, lp) == pytest.approx(lp)


def test_top_logprobs_in_requests(client, server):
    reply = _chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    for entry in reply.choices[0].logprobs.content:
        top = entry.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert (top[0].token, top[0].logprob) == (entry.token, pytest.approx(entry.logprob))  # greedy: the top one
    status, body = _post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4,
                                                     "temperature": 0.9, "seed": 2, "logprobs": 2})
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert status == 200 and len(tops) == len(body["choices"][0]["logprobs"]["tokens"])
    assert all(1 <= len(t) <= 2 for t in tops)
    status, body = _post(server, "/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 6})
    assert status == 400 and body["error"]["param"] == "top_logprobs" and "the 5 this program" in \
        body["error"]["message"]


def test_multi_turn_equals_transformers_and_reuses_the_cache(client, reference):
    _, first = reference(HELLO)
    assert _chat(client, temperature=0, max_tokens=16).choices[0].message.content == first
    conversation = HELLO + [{"role": "assistant", "content": first}, {"role": "user", "content": "The fox"}]
    want, text = reference(conversation)
    reply = _chat(client, conversation, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == text
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert len(reference.prompt(HELLO)) <= cached
    assert cached < reply.usage.prompt_tokens


def test_a_conversation_comes_back_to_its_cache_across_others(client):
    """serve keeps other conversations' caches (--prompt-cache-bytes, 2 GiB
    by default): A, then B, then A's next turn reuses A's prompt and more."""
    conversation_comes_back(client)


def conversation_comes_back(client) -> None:
    first = [{"role": "user", "content": "Once upon a time"}]
    a = _chat(client, first, temperature=0, max_tokens=8)
    _chat(client, [{"role": "user", "content": "The quick brown fox"}], temperature=0, max_tokens=8)
    turn = first + [{"role": "assistant", "content": a.choices[0].message.content},
                    {"role": "user", "content": "and then"}]
    again = _chat(client, turn, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens


def test_concurrent_clients_equal_serial(client):
    requests = [dict(temperature=1.1, seed=s, max_tokens=16, messages=[{"role": "user", "content": p}])
                for s, p in ((1, "The fox"), (2, "Once upon a time"), (3, "The sun rose"), (4, "The fox"))]
    serial = [_chat(client, **r).choices[0].message.content for r in requests]
    results = [None] * len(requests)

    def ask(i):
        if i % 2:
            results[i] = _streamed(client, **requests[i])[0]
        else:
            results[i] = _chat(client, **requests[i]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == serial


@pytest.mark.parametrize("body,param", [
    ({"messages": HELLO, "top_p": 1.5}, "top_p"),
    ({"messages": HELLO, "logit_bias": {"12": 500}}, "logit_bias"),
    ({"messages": HELLO, "n": 17}, "n"),
    ({"messages": HELLO, "max_tokens": 10_000}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "temperature": -1}, "temperature"),
    ({"messages": HELLO, "stop": 3}, "stop"),
    ({"messages": HELLO, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"messages": HELLO, "tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": HELLO, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": HELLO + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, "messages"),
])
def test_malformed_requests_get_400_naming_the_field(server, client, body, param):
    status, reply = _post(server, "/v1/chat/completions", {**body, "unknown_field": "ignored"})
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
    assert param in reply["error"]["message"] or param == "messages"
    assert _chat(client, temperature=0, max_tokens=2).usage.completion_tokens >= 1  # still answering


# ------------------------------------------------------------ tool calls --
def _arguments_valid(call) -> dict:
    import jsonschema

    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def test_forced_tool_calls_always_validate(client):
    """tool_choice required and a named function, random weights at T=1:
    every answer is calls whose arguments validate (20/20 each)."""
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        for seed in range(20):
            [choice_] = _chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                              max_tokens=128).choices
            assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
            calls = choice_.message.tool_calls
            assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
            for call in calls:
                _arguments_valid(call)
            if choice is named:
                assert [c.function.name for c in calls] == ["add"]


def test_streamed_tool_calls_equal_the_whole_answer(client):
    whole = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=128)
    calls, finish, content = {}, None, ""
    for chunk in _chat(client, stream=True, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7,
                       max_tokens=128):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    want = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == want and finish == "tool_calls" and content == ""


def test_tool_results_go_back_through_the_template(client, reference):
    """The assistant's call and the tool's answer are rendered as
    transformers renders them (the prompt's tokens), and the greedy answer
    that follows is transformers' on that prompt."""
    [call] = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, seed=3,
                   temperature=1.0, max_tokens=64).choices[0].message.tool_calls
    messages = HELLO + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    reply = _chat(client, messages, tools=TOOLS, temperature=0, max_tokens=12)
    as_template_takes = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": _arguments_valid(call)}}]},
        messages[-1]]
    ids = reference.prompt(as_template_takes, TOOLS)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == reference(ids=ids, n=12)[1]


def test_a_template_without_tools_refuses_them_by_name(model, tmp_path):
    """A folder whose template shows no tools: 400 `tools` (the server's
    parse), ValueError from the Python API; without tools it chats."""
    import shutil

    from executorch_mlx.llm.run.runner import LLMRunner
    from executorch_mlx.serve.requests import RequestError, parse

    folder = Path(shutil.copytree(model.folder, tmp_path / "plain"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}<|im_start|>assistant\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    runner = LLMRunner(model.pte, folder)
    with pytest.raises(RequestError, match="shows no tools") as refused:
        parse({"messages": HELLO, "tools": TOOLS}, runner, chat=True)
    assert refused.value.param == "tools"
    with pytest.raises(ValueError, match="shows no tools"):
        runner.chat(HELLO, tools=TOOLS, max_new_tokens=2)
    assert parse({"messages": HELLO, "tool_choice": "none"}, runner, chat=True).plans[0].tool_use is None


def test_terminal_chat_with_tools_asks_for_each_result(model, tmp_path, capsys):
    """`chat --tools`: a forced call is printed, its result asked for and
    sent back as the tool's message; the model then answers freely."""
    import io

    from executorch_mlx.cli import main
    from executorch_mlx.llm.run.chat_loop import ChatSettings, chat_loop
    from executorch_mlx.llm.run.runner import LLMRunner

    typed, asked = iter(["Once upon a time", "42"]), []

    def read(prompt: str) -> str:
        asked.append(prompt)
        line = next(typed, None)
        if line is None:
            raise EOFError  # (the end of input ends the chat)
        return line

    out = io.StringIO()
    settings = ChatSettings(max_new_tokens=48, sampling={"temperature": 1.0, "seed": 1}, tools=TOOLS,
                            tool_choice={"type": "function", "function": {"name": "add"}})
    assert chat_loop(LLMRunner(model.pte, model.folder), settings, read, out, io.StringIO()) == 0
    assert asked == ["> ", "add result> ", "> "]
    [arguments] = [line[len("[call add "):-1] for line in out.getvalue().splitlines() if line.startswith("[call add ")]
    assert 0 <= json.loads(arguments)["a"] <= 99
    (tmp_path / "tools.json").write_text("[{")
    assert main(["chat", str(model.pte), "--tokenizer", str(model.folder), "--tools", str(tmp_path / "tools.json")]) \
        != 0
    assert "--tools" in capsys.readouterr().err


def test_n_choices_are_each_what_its_seed_gives_alone(client, server):
    """n=3: choice i is what the request alone gives with choice i's seed
    (choice 0: the request's own, docs/serve.md); streamed, the same texts by
    index; usage counts the prompt once and every choice's tokens."""
    from executorch_mlx.serve.requests import choice_seed

    kw = dict(temperature=1.2, max_tokens=12)
    reply = _chat(client, n=3, seed=11, **kw)
    texts = [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
    alone = [_chat(client, seed=choice_seed(11, i), **kw) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone] and len(set(texts)) > 1
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed, finished = {}, {}
    for chunk in _chat(client, n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            finished[c.index] = c.finish_reason or finished.get(c.index)
    assert [streamed[i] for i in range(3)] == texts
    assert [finished[i] for i in range(3)] == [c.finish_reason for c in sorted(reply.choices, key=lambda c: c.index)]
    status, body = _post(server, "/v1/completions", {"prompt": "Once upon a time", "n": 2, "seed": 3,
                                                     "temperature": 1.0, "max_tokens": 6})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]


# --------------------------------------------------------------- responses --
def test_responses_create_answers_as_the_chat_request_it_means(client, reference):
    """The official client's responses.create: `input` text or messages (text
    parts), `instructions` as the system message, `max_output_tokens`; the
    Response holds transformers' greedy text, its status and usage."""
    want, text = reference(HELLO)
    eos = {1, reference.tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])}
    reply = client.responses.create(model="model", input="Once upon a time", max_output_tokens=16, temperature=0)
    assert reply.output_text == text and reply.id.startswith("resp-")
    assert reply.status == ("completed" if want[-1] in eos else "incomplete")
    assert reply.usage.output_tokens == len(want) and reply.usage.input_tokens == len(reference.prompt(HELLO))
    system = [{"role": "system", "content": "Be brief."}, *HELLO]
    _, brief = reference(system)
    reply = client.responses.create(model="model", instructions="Be brief.", temperature=0, max_output_tokens=16,
                                    input=[{"role": "user", "content": [{"type": "input_text",
                                                                         "text": "Once upon a time"}]}])
    assert reply.output_text == brief and reply.instructions == "Be brief."


def test_responses_stream_events_in_order_with_the_whole_text(client):
    kw = dict(model="model", input="Once upon a time", max_output_tokens=24, temperature=1.1, top_p=0.9,
              include=["message.output_text.logprobs"], extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text == events[-1].response.output_text
    entries = whole.output[0].content[0].logprobs
    assert "".join(e.token for e in entries) == whole.output_text and all(e.logprob <= 0 for e in entries)
    streamed = [e for d in deltas for e in d.logprobs]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # (float rounding apart: the two prefilled different parts of the prompt past the cached prefix)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)


def test_responses_function_tools(client, reference):
    """Responses' flat function tools: a forced call comes back as a
    function_call item (streamed: its events, the same call); the call and
    its output sent back as input items are the chat messages they mean."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model="model", input="Once upon a time", tools=tools, tool_choice={"type": "function", "name": "add"},
              temperature=1.0, max_output_tokens=64, extra_body={"seed": 4})
    reply = client.responses.create(**kw)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "add" and reply.status == "completed"
    jsonschema_args = json.loads(call.arguments)
    assert 0 <= jsonschema_args["a"] <= 99 and set(jsonschema_args) == {"a"}
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[4].arguments == call.arguments and events[-1].response.output[0].name == "add"
    follow = client.responses.create(model="model", tools=tools, temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "Once upon a time"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
    messages = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": jsonschema_args}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "42"}]
    ids = reference.prompt(messages, TOOLS)
    assert follow.usage.input_tokens == len(ids) and follow.output_text == reference(ids=ids, n=8)[1]


def test_responses_text_format_json_schema_is_enforced(client):
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": {"type": "boolean"}, "strict": True}}
    for seed in range(2):
        reply = client.responses.create(model="model", input="Once upon a time", text=fmt, temperature=1.0,
                                        max_output_tokens=16, extra_body={"seed": seed})
        assert json.loads(reply.output_text) in (True, False) and reply.status == "completed"


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f b"}]}, "tools"),
    ({"input": "hi", "previous_response_id": "resp-1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "temperature": -1}, "temperature"),
])
def test_responses_refuse_what_they_cannot_do_naming_the_field(server, body, param):
    status, reply = _post(server, "/v1/responses", body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_invalid_json_and_unknown_routes(server):
    assert _post(server, "/v1/chat/completions", b"{not json")[0] == 400
    status, body = _post(server, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "error" in body


def test_a_client_that_disconnects_stops_its_generation(server, client, reference):
    """The server stops at the next token: the cache then holds less than the
    whole generation (cached_tokens of a request that repeats it says so)."""
    prompt = reference.tokenizer("Once upon a time")["input_ids"]
    n = MAX_CONTEXT - len(prompt) - 1
    eos = [1, reference.tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])]
    want, _ = reference(ids=prompt, n=n, suppress_tokens=eos)  # eos banned: it runs to max_tokens
    fields = {"max_tokens": n, "temperature": 0, "logit_bias": {str(t): -100 for t in eos}}
    conn = http.client.HTTPConnection("127.0.0.1", server[1], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "stream": True, **fields}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    follow = _post(server, "/v1/completions", {"prompt": prompt + want[:-1], "max_tokens": 1, "temperature": 0})[1]
    cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(prompt) <= cached < len(prompt) + n - 2, cached  # stopped well before the end
    # the reference is the server's whole answer (after: the prompt cache would keep it for the follow-up)
    status, body = _post(server, "/v1/completions", {"prompt": prompt, **fields})
    assert body["choices"][0]["text"] == reference.tokenizer.decode(want, skip_special_tokens=True)
    assert _chat(client, temperature=0, max_tokens=16).choices[0].message.content == reference(HELLO)[1]


def test_readme_curl_and_openai_examples(model, server, capsys):
    """The README's curl and openai-client blocks against the README's server:
    the same request, so the same text (streamed by one, whole from the other)."""
    root = model.root
    curl = subprocess.run(["bash", "-e", "-c", _shell("\n".join(runnable(README, "serve-curl")), server[1])],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert curl.returncode == 0, curl.stderr
    whole = json.loads(curl.stdout)["choices"][0]["message"]["content"]
    code = _shell("\n".join(runnable(README, "serve-openai")), server[1])
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out == whole and whole
