"""Issue 38 item 2: continuous batching. The chat folder of test_serve.py is
exported with `--max-batch 4`; its server (the README's serve line, on a
free port of 127.0.0.1) runs requests side by side, and each request gets
what it gets alone, driven by the official `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import jsonschema
import pytest

from llm_programs import batched_chat_program
from test_serve import (HELLO, MAX_CONTEXT, TOOLS, _arguments_valid, _chat, _free_port, _streamed,
                        conversation_comes_back, wait_until_serving)

POEM = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                         "lines": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["title", "lines"], "additionalProperties": False}


@pytest.fixture(scope="module")
def batched(shared):
    """(the folder, the B=4 program, the B=1 program) of test_serve's chat folder."""
    return batched_chat_program(shared)


@pytest.fixture(scope="module")
def client(batched, tmp_path_factory):
    from openai import OpenAI

    folder, pte, _ = batched
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "executorch_mlx.cli", "serve", str(pte), "--tokenizer",
                               str(folder), "--port", str(port), "--quiet"], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ})
    wait_until_serving(port, server, log)
    yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=90)
    server.terminate()
    server.wait(timeout=30)
    log.close()


def _together(calls) -> list:
    """Runs the calls at once, each on a thread of its own; their results."""
    results = [None] * len(calls)
    errors = []

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as e:  # (reported below, with the others)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def _answer(reply) -> tuple:
    """What a whole chat answer says: text, finish reason, logprobs."""
    choice = reply.choices[0]
    logprobs = [(e.token, round(e.logprob, 4)) for e in choice.logprobs.content] if choice.logprobs else None
    return choice.message.content, choice.finish_reason, logprobs, reply.usage.completion_tokens


REQUESTS = [  # greedy and sampled rows, each with its own settings, prompts of different lengths
    dict(messages=HELLO, temperature=0, max_tokens=24, logprobs=True),
    dict(messages=[{"role": "user", "content": "The quick brown fox jumps over the lazy dog, then"}],
         temperature=1.1, seed=5, top_p=0.9, max_tokens=30),
    dict(messages=[{"role": "user", "content": "Rain"}], temperature=0.8, seed=9, frequency_penalty=0.7,
         max_tokens=20, logprobs=True, top_logprobs=3),
    dict(messages=[{"role": "user", "content": "A poem, as JSON"}], temperature=1.0, seed=2, max_tokens=60,
         response_format={"type": "json_schema", "json_schema": {"name": "poem", "schema": POEM}}),
]


def test_concurrent_requests_each_equal_the_request_alone(client, batched):
    """4 seeded requests at once on the --max-batch 4 program, whole and
    streamed, each equal what it gives alone; greedy equals the B=1
    program's answer in-process too."""
    from executorch_mlx.llm.run.runner import LLMRunner

    alone = [_answer(_chat(client, **r)) for r in REQUESTS]
    together = _together([lambda r=r: _answer(_chat(client, **r)) for r in REQUESTS])
    assert together == alone
    jsonschema.validate(json.loads(alone[3][0]), POEM)
    streamed = _together([lambda r=r: _streamed(client, **{k: v for k, v in r.items() if "logprobs" not in k})[:2]
                          for r in REQUESTS])
    assert streamed == [a[:2] for a in alone]
    folder, _, single = batched
    reply = LLMRunner(single, folder).chat(HELLO, max_new_tokens=24)
    assert reply.text == alone[0][0]


def test_a_request_runs_beside_a_long_one(client, batched):
    """Admitted between calls: a short request sent once a long one streams
    ends before it (one at a time, it would wait for the whole long answer)."""
    from tokenizers import Tokenizer

    end = Tokenizer.from_file(str(batched[0] / "tokenizer.json")).token_to_id("<|im_end|>")
    long = dict(messages=HELLO, temperature=0.9, seed=1, max_tokens=MAX_CONTEXT - 40,
                logit_bias={str(end): -100})  # (no end before max_tokens)
    short = dict(messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4)
    streaming, ends = threading.Event(), {}

    def run_long():
        pieces = 0
        for chunk in _chat(client, stream=True, **long):
            pieces += 1
            streaming.set()
        ends["long"] = time.monotonic()
        return pieces

    thread = threading.Thread(target=run_long)
    thread.start()
    assert streaming.wait(60)
    reply = _chat(client, **short)
    ends["short"] = time.monotonic()
    thread.join(120)
    assert ends["short"] < ends["long"]
    assert reply.choices[0].message.content == _chat(client, **short).choices[0].message.content


def test_n_choices_run_side_by_side_as_each_seed_alone(client):
    from executorch_mlx.serve.requests import choice_seed

    kw = dict(temperature=1.2, max_tokens=12)
    reply = _chat(client, n=3, seed=11, **kw)
    texts = [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
    alone = [_chat(client, seed=choice_seed(11, i), **kw).choices[0].message.content for i in range(3)]
    assert texts == alone and len(set(texts)) > 1


def test_conversations_come_back_across_others(client):
    """A, then B (in A's row: A is kept), then A's next turn reuses A's prompt."""
    conversation_comes_back(client)


def test_forced_tool_calls_side_by_side(client):
    """Four forced calls at once, each row under its own grammar mask."""
    calls = _together([lambda s=s: _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=s,
                                         max_tokens=120) for s in range(4)])
    for reply in calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in reply.choices[0].message.tool_calls:
            _arguments_valid(call)
