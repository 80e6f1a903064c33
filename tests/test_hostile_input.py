"""Issue 39: the server and the CLI under hostile input.

One server, started as a user would (`executorch-mlx serve --api-key ...`,
with a 2 s header timeout so that the slow-client test is short) on a free
port of 127.0.0.1, serves the tiny chat program of test_serve.py. A process
asks /health every 0.1 s from start to end; the last test holds it to 1 s.
Each hostile row must end in a JSON 4xx within 2 s and leave the server's
memory and its answers as they were."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from executorch_mlx.cli import main
from executorch_mlx.serve.app import ServeOptions, access_middleware
from llm_programs import chat_program

KEY = "sk-test-7f3a"
HEADER_TIMEOUT = 2.0
FAST = 2.0  # seconds a hostile request may take
HELLO = [{"role": "user", "content": "Once upon a time"}]


# Asks /health every 0.1 s; answers each line it reads with [slowest seconds,
# failures] so far, and ends at the end of its input.
_WATCH = r"""
import http.client, json, select, sys, time
port, slowest, failures = int(sys.argv[1]), 0.0, []
while True:
    start = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        if status != 200:
            failures.append(f"status {status}")
    except OSError as e:
        failures.append(repr(e))
    slowest = max(slowest, time.monotonic() - start)
    if select.select([sys.stdin], [], [], 0.1)[0]:
        if not sys.stdin.readline():
            break
        print(json.dumps([slowest, failures]), flush=True)
"""


class HealthWatch:
    """/health asked every 0.1 s by a process of its own: a thread of the
    test process would time its own waits for the GIL too (the tests run
    the CLI in this process)."""

    def __init__(self, port: int):
        self.process = subprocess.Popen([sys.executable, "-c", _WATCH, str(port)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def report(self) -> tuple[float, list[str]]:
        """(the slowest answer so far in seconds, the failed asks)"""
        self.process.stdin.write("report\n")
        self.process.stdin.flush()
        slowest, failures = json.loads(self.process.stdout.readline())
        return slowest, failures

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=10)


@dataclass
class Served:
    folder: Path
    pte: Path
    port: int
    process: subprocess.Popen
    health: HealthWatch

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def cpu_seconds(self) -> float:
        """The server's user + system time (clock ticks of /proc/PID/stat)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def served(shared, tmp_path_factory):
    folder, pte = chat_program(shared, 256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("hostile") / "server.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "executorch_mlx.cli", "serve", str(pte), "--tokenizer",
                                str(folder), "--port", str(port), "--api-key", KEY, "--header-timeout",
                                str(HEADER_TIMEOUT), "--quiet"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                break
        except OSError:
            log.seek(0)
            assert process.poll() is None, f"the server exited: {log.read()}"
            assert time.monotonic() < deadline, f"the server did not start: {log.read()}"
            time.sleep(0.2)
    health = HealthWatch(port)
    yield Served(folder, pte, port, process, health)
    health.stop()
    process.terminate()
    process.wait(timeout=30)
    log.close()


def request(served, path: str, body, headers: dict | None = None, method: str = "POST",
            chunked: bool = False) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one request with the right key, JSON
    content type and host unless `headers` say otherwise."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    sent = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    start = time.monotonic()
    if chunked:
        step = 1 << 20
        pieces = (data[i:i + step] for i in range(0, len(data), step))
        conn.request(method, path, pieces, sent, encode_chunked=True)
    else:
        conn.request(method, path, data, sent)
    response = conn.getresponse()
    payload = response.read()
    seconds = time.monotonic() - start
    conn.close()
    return response.status, json.loads(payload), seconds


def chat(served, **fields) -> tuple[int, dict, float]:
    return request(served, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "temperature": 0, **fields})


def refused(reply: dict, code: int, status: int, seconds: float, param: str | None = None,
            limit: float = FAST) -> str:
    assert status == code and seconds < limit, (status, seconds, reply)
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_20_mb_body_is_413_at_once(served, chunked):
    """Content-Length over the limit is refused before a byte is read; a
    chunked body (no length) when its count passes the limit."""
    before = served.rss_mb()
    body = {"messages": [{"role": "user", "content": "a " * (10 << 20)}]}
    status, reply, seconds = request(served, "/v1/chat/completions", body, chunked=chunked)
    assert status == 413 and reply["error"]["code"] == "request_too_large" and seconds < FAST, (status, seconds)
    assert "--max-request-bytes" in reply["error"]["message"]
    assert served.rss_mb() - before < 500


@pytest.mark.parametrize("route,field_name", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"),
                                              ("/v1/responses", "input")])
def test_a_long_prompt_is_measured_not_tokenized(served, route, field_name):
    """6 MB of text under the body limit: refused against the context by its
    size, in far less than tokenizing it would take."""
    before = served.rss_mb()
    text = "Once upon a time " * (6 << 20 >> 4)
    body = {"messages": [{"role": "user", "content": text}]} if field_name == "messages" else {field_name: text}
    status, reply, seconds = request(served, route, body)
    message = refused(reply, 400, status, seconds, field_name)
    assert reply["error"]["code"] == "context_length_exceeded" and "bytes" in message
    assert served.rss_mb() - before < 500


def test_lone_surrogates_are_400_naming_the_field(served):
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    status, reply, seconds = request(served, "/v1/chat/completions", raw)
    assert "not valid Unicode" in refused(reply, 400, status, seconds, "messages")
    status, reply, seconds = request(served, "/v1/completions", b'{"prompt": "\\udc80"}')
    assert "not valid Unicode" in refused(reply, 400, status, seconds, "prompt")
    status, reply, seconds = request(served, "/v1/chat/completions", b'{"messages": [], "stop": ["\\ud800"]}')
    refused(reply, 400, status, seconds, "stop")
    status, reply, seconds = request(served, "/v1/responses", b'{"input": "a\\udc80"}')
    assert "not valid Unicode" in refused(reply, 400, status, seconds, "input")


def test_deep_nesting_is_400(served):
    for depth in (100_000, 200):
        status, reply, seconds = request(served, "/v1/chat/completions", b"[" * depth + b"]" * depth)
        assert "nests deeper" in refused(reply, 400, status, seconds)
    deep = {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
    node = deep["response_format"]["json_schema"]["schema"]
    for _ in range(200):
        node["items"] = {}
        node = node["items"]
    status, reply, seconds = request(served, "/v1/chat/completions", deep)
    assert "nests deeper" in refused(reply, 400, status, seconds, "response_format")


def _refusal_cpu_seconds(folder: Path, schema: dict) -> float:
    """llguidance's CPU time to refuse `schema` in this process, on the folder's tokenizer."""
    from tokenizers import Tokenizer

    from executorch_mlx.llm.run.grammar import TokenConstraint, grammar_text, grammar_tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lltok = grammar_tokenizer(tokenizer, tokenizer.get_vocab_size(), set())
    start = time.process_time()
    with pytest.raises(ValueError):
        TokenConstraint(grammar_text(json_schema=schema), lltok)
    return time.process_time() - start


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "fails on its first tokens"),
    ({"type": "string", "pattern": "^((a{100}){100}){100}$"}, "fails on its first tokens"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
      "required": ["a"]}, "Unsatisfiable"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
])
def test_grammars_llguidance_rejects_are_400_without_its_state(served, schema, words):
    """The billion-state pattern costs llguidance a second or two of CPU
    (0.9-1.3 s measured alone on one machine, 1.6 on another): the server
    spends at most half as much again as llguidance's own refusal measured
    here (the same machine and load), or 2 s; wall time twice that, which
    the other test worker shares."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    own = _refusal_cpu_seconds(served.folder, schema)
    cpu = served.cpu_seconds()
    status, reply, seconds = chat(served, response_format=fmt)
    budget = max(FAST, 1.5 * own + 0.5)
    assert served.cpu_seconds() - cpu < budget
    message = refused(reply, 400, status, seconds, "response_format", limit=2 * budget)
    assert words in message and "\n" not in message and "<state>" not in message and "Parser" not in message


def test_schemas_are_bounded(served):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12_000)}}
    status, reply, seconds = chat(served, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": schema}})
    assert "at most 262144" in refused(reply, 400, status, seconds, "response_format")


def test_stop_strings_are_bounded(served):
    status, reply, seconds = chat(served, stop=[f"s{i}" for i in range(50_000)])
    assert "at most 16" in refused(reply, 400, status, seconds, "stop")
    status, reply, seconds = chat(served, stop=["x" * 10_000])
    assert "at most 256" in refused(reply, 400, status, seconds, "stop")


def test_the_api_key_is_needed_on_v1_only(served):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        status, reply, _ = request(served, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}, headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", (headers, status, reply)
    status, reply, _ = request(served, "/v1/models", None, {"Authorization": ""}, method="GET")
    assert status == 401
    status, reply, _ = request(served, "/health", None, {"Authorization": ""}, method="GET")
    assert status == 200 and reply == {"status": "ok"}
    status, reply, _ = chat(served)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1


def test_only_json_bodies_from_the_servers_own_host(served):
    body = json.dumps({"messages": HELLO}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        status, reply, _ = request(served, "/v1/chat/completions", body, {"Content-Type": kind})
        assert status == 415 and reply["error"]["code"] == "unsupported_media_type", (kind, status)
    status, reply, _ = request(served, "/v1/chat/completions", body, {"Host": "attacker.example:8080"})
    assert status == 400 and reply["error"]["code"] == "invalid_host"
    status, reply, _ = request(served, "/v1/chat/completions", body, {"Origin": "https://attacker.example"})
    assert status == 403 and reply["error"]["code"] == "origin_not_allowed"
    for host in ("localhost", f"localhost:{served.port}", f"127.0.0.1:{served.port}", "[::1]:80"):
        assert request(served, "/health", None, {"Host": host}, method="GET")[0] == 200, host


def test_slow_headers_are_closed(served):
    """50 clients that send a header line every 0.5 s: each connection is
    closed by the header timeout, not held."""
    clients = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", served.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.settimeout(0.05)
        clients.append(s)
    start, open_ = time.monotonic(), set(range(50))
    while open_ and time.monotonic() - start < HEADER_TIMEOUT + 5:
        for i in list(open_):
            try:
                clients[i].sendall(b"X-Slow: 1\r\n")
                if clients[i].recv(1) == b"":
                    open_.discard(i)
            except socket.timeout:
                pass
            except OSError:  # reset: closed
                open_.discard(i)
        time.sleep(0.5)
    closed_after = time.monotonic() - start
    for s in clients:
        s.close()
    assert not open_ and closed_after < HEADER_TIMEOUT + 3, (len(open_), closed_after)


@pytest.mark.parametrize("head", [b"GARBAGE\r\n\r\n",  # headers never ending, past h11's 16 KiB:
                                  b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: aaaaaaaa\r\n" * 4000])
def test_requests_http_cannot_parse_get_json_too(served, head):
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(head)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status, _, rest = reply.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in rest.lower(), reply[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http_request"


def test_cli_hostile_files_and_text_exit_2_in_one_line(served, capsys):
    base = ["generate", str(served.pte), "--tokenizer", str(served.folder), "--max-new-tokens", "2"]
    cases = [["--prompt", "hi", "--json-schema", "/dev/zero"], ["--prompt", "hi", "--grammar", "/dev/zero"],
             ["--prompt", "a\udc80b"], ["--prompt", "hi", "--stop", "x" * 1000],
             ["--prompt", "hi", "--regex", "^((a{100}){100}){100}$"]]
    for extra in cases:
        start = time.monotonic()
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert time.monotonic() - start < FAST + 2 and err.count("\n") == 1, (extra, err)
        assert err.startswith("executorch-mlx generate: error: ") and "Traceback" not in err


def test_the_server_answered_health_throughout(served):
    status, reply, _ = chat(served)
    assert status == 200 and reply["choices"][0]["message"]["content"] is not None
    slowest, failures = served.health.report()
    assert not failures and slowest < 1.0, (failures, slowest)


def _access_app(**options) -> TestClient:
    """The server's access middleware around one route, as create_app wires it."""
    async def ok(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/x", ok, methods=["GET", "POST"])],
                    middleware=access_middleware(ServeOptions(**options)))
    return TestClient(app, base_url="http://localhost")


def test_hosts_by_bind_address_and_allowed_hosts():
    local = _access_app()
    assert local.get("/v1/x", headers={"Host": "192.168.1.5"}).status_code == 400
    assert local.get("/v1/x", headers={"Host": "rebind.attacker.example"}).status_code == 400
    wildcard = _access_app(host="0.0.0.0")
    assert wildcard.get("/v1/x", headers={"Host": "192.168.1.5:8080"}).status_code == 200
    assert wildcard.get("/v1/x", headers={"Host": "rebind.attacker.example"}).status_code == 400
    named = _access_app(host="0.0.0.0", allowed_hosts=("llm.lan",))
    assert named.get("/v1/x", headers={"Host": "LLM.lan:8080"}).status_code == 200
    assert _access_app(allowed_hosts=("*",)).get("/v1/x", headers={"Host": "any.example"}).status_code == 200


def test_cors_only_for_allowed_origins():
    closed = _access_app()
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    assert "access-control-allow-origin" not in closed.options("/v1/x", headers=preflight).headers
    opened = _access_app(allowed_origins=("https://app.example",), api_key="k")
    reply = opened.options("/v1/x", headers=preflight)  # no key on a preflight: browsers send none
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
    reply = opened.post("/v1/x", json={}, headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
    assert opened.post("/v1/x", json={}, headers={"Origin": "https://evil.example"}).status_code == 403


def test_a_body_that_trickles_is_408():
    import asyncio

    from starlette.requests import Request

    from executorch_mlx.serve.body import BodyError, read_body

    async def trickle():
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": b"{", "more_body": True}

    async def read(timeout, idle):
        request = Request({"type": "http", "method": "POST", "headers": []}, trickle)
        return await read_body(request, limit=1000, timeout=timeout, idle=idle)

    for timeout, idle in ((0.5, 10.0), (10.0, 0.05)):  # too slow in all; a pause too long
        with pytest.raises(BodyError) as refused_body:
            asyncio.run(read(timeout, idle))
        assert refused_body.value.status == 408


def test_our_own_bug_is_a_json_500(served):
    """An exception the server does not expect (a bug of ours) is still
    OpenAI's JSON error body, with no traceback in it."""
    from executorch_mlx.llm.run.runner import LLMRunner
    from executorch_mlx.serve.app import create_app

    runner = LLMRunner(served.pte, served.folder)

    def broken(*args, **kwargs):
        raise TypeError("a bug")

    runner.run = broken
    with TestClient(create_app(runner, "m"), base_url="http://localhost", raise_server_exceptions=False) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 500 and reply.json()["error"] == {
        "message": "internal error: TypeError", "type": "server_error", "param": None, "code": None}
