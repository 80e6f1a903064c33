"""`executorch-mlx serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn).

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one model
    POST /v1/chat/completions    messages -> the chat template -> generate
    POST /v1/completions         prompt (text or token ids) -> generate
    POST /v1/responses           OpenAI's Responses API: as a chat request (responses.py)

A program exported with one cache row runs requests one at a time, in
arrival order, on one worker thread (the event loop never waits on a
generation); the runner reuses the cache's common prefix with the last
request (a conversation's next turn prefills only the new messages), and
its prompt cache keeps other conversations' caches for their next turns
(--prompt-cache-bytes). A batched program (export --max-batch N) runs up
to N generations at once, admitted between its calls (llm/run/batch.py):
the choices of a request with n > 1 run side by side, and conversations are
kept for their next turns as with one row. A request whose client goes away
is cancelled at its next token.
Request fields and what they map to: docs/serve.md.

Hostile input costs little: guard.py checks the headers (host, origin, API
key, content type) before any route; a body is read up to
`max_request_bytes` within `body_timeout`, and checked (JSON, nesting,
Unicode, then each field, the prompt measured before it is tokenized) on a
thread of its own, so the event loop keeps answering; http_protocol.py closes
connections whose headers do not arrive in time. Every error, ours included,
is OpenAI's JSON error body.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..llm.run.batch import Batch
from ..llm.run.grammar import GrammarError
from ..llm.run.runner import GenerationResult, LLMRunner
from .body import BodyError, read_body
from .guard import AccessPolicy, Guard
from .requests import Request, RequestError, decode_body, parse
from .responses import RESPONSES_FIELDS, ResponseBuilder, chat_body, response_usage

# (the grammar allowing nothing more ends the answer as the model's end would)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "cancelled": "stop",
                  "grammar": "stop"}
_DONE = object()


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens and what it takes (the `serve` command's flags)."""

    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str | None = None  # default: the .pte's file name
    quiet: bool = False
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = 8 * 1024 * 1024
    header_timeout: float = 10.0  # seconds for a request's headers
    body_timeout: float = 60.0  # seconds for its body (and at most 10 without a byte)
    prompt_cache_bytes: int = 2 << 30  # other conversations' caches kept (0: none; llm/run/prompt_cache.py)

    @property
    def policy(self) -> AccessPolicy:
        return AccessPolicy(self.host, self.api_key, self.allowed_hosts, self.allowed_origins)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


class _Job:
    """One request's generation: its choices one after another on the
    worker thread (`run`), or side by side on a batched program (`submit`).
    Streamed, each choice's pieces of text with their tokens, then its
    result, reach the event loop through a queue: (index, piece, tokens),
    then (index, None, result), and _DONE after the last choice."""

    def __init__(self, request: Request, runner: LLMRunner, loop: asyncio.AbstractEventLoop):
        self.request, self.runner, self.loop = request, runner, loop
        streamed = request.stream
        self.cancelled = threading.Event()
        self.queue: asyncio.Queue | None = asyncio.Queue() if streamed else None
        # each choice's tokens not yet sent with a piece of text
        self.tokens: list[list[tuple[int, float | None]]] = [[] for _ in request.plans]

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _callbacks(self, index: int):
        """Choice `index`'s on_text (None unless streamed) and on_token."""
        def on_token(token: int, logprob: float | None) -> bool:
            self.tokens[index].append((token, logprob))
            return self.cancelled.is_set()

        def on_text(piece: str) -> None:
            tokens, self.tokens[index] = self.tokens[index], []
            self._put((index, piece, tokens))

        return (on_text if self.queue is not None else None), on_token

    def _finished(self, index: int, result: GenerationResult) -> None:
        if self.queue is not None:
            if self.tokens[index]:
                self._callbacks(index)[0]("")
            self._put((index, None, result))

    def run(self) -> list[GenerationResult] | None:
        """Each choice's result; None when its client left before it ran."""
        results = []
        try:
            for index, plan in enumerate(self.request.plans):
                if self.cancelled.is_set():  # its client left (while it waited, or during a choice)
                    return results or None
                on_text, on_token = self._callbacks(index)
                results.append(self.runner.run(plan, on_text=on_text, on_token=on_token))
                self._finished(index, results[-1])
            return results
        finally:
            if self.queue is not None:
                self._put(_DONE)

    def submit(self, batch: Batch) -> asyncio.Future:
        """Every choice into `batch` at once; the future of their results."""
        done = self.loop.create_future()
        futures = [batch.submit(plan, *self._callbacks(i)) for i, plan in enumerate(self.request.plans)]
        left, counting = [len(futures)], threading.Lock()

        def finish() -> None:  # on the event loop, after the last choice
            if self.queue is not None:
                self.queue.put_nowait(_DONE)
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result([f.result() for f in futures])

        def ended(index: int, future) -> None:  # on the batch's thread (or here, if it ended already)
            if future.exception() is None:
                self._finished(index, future.result())
            with counting:
                left[0] -= 1
                last = not left[0]
            if last:
                self.loop.call_soon_threadsafe(finish)

        for i, future in enumerate(futures):
            future.add_done_callback(lambda f, i=i: ended(i, f))
        return done


class Server:
    def __init__(self, runner: LLMRunner, model_name: str, draft: dict, options: ServeOptions):
        self.runner, self.model_name, self.draft, self.options = runner, model_name, draft, options
        self.created = int(time.time())
        # One worker: requests run one at a time, in the order they came;
        # a batched program runs them together instead.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.batch = Batch(runner, options.prompt_cache_bytes) if runner.max_batch > 1 else None
        # Requests are checked (and their prompts tokenized) beside it, off the event loop.
        self.checker = ThreadPoolExecutor(max_workers=2, thread_name_prefix="check")

    # ----------------------------------------------------------- routes --
    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "executorch-mlx"}]})

    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat")

    async def completions(self, request: Request):
        return await self._complete(request, "completion")

    async def responses(self, request: Request):
        return await self._complete(request, "response")

    def _parse(self, raw: bytes, api: str) -> tuple[Request, dict]:
        """The checked request of `api` (chat, completion or response) and its body."""
        body = decode_body(raw)
        if api != "response":
            return parse(body, self.runner, api == "chat", self.draft), body
        try:
            return parse(chat_body(body), self.runner, True, self.draft), body
        except RequestError as e:  # named by the field the client sent
            e.param = RESPONSES_FIELDS.get(e.param, e.param)
            raise

    async def _complete(self, request: Request, api: str):
        try:
            raw = await read_body(request, self.options.max_request_bytes, self.options.body_timeout)
        except BodyError as e:
            return error_response(e.status, str(e), code=e.code)
        except ClientDisconnect:
            return error_response(499, "the client closed the request")
        loop = asyncio.get_running_loop()
        try:
            parsed, body = await loop.run_in_executor(self.checker, lambda: self._parse(raw, api))
        except RequestError as e:
            return error_response(400, str(e), e.param, e.code)
        chat = parsed.chat
        job = _Job(parsed, self.runner, loop)
        prefix = {"chat": "chatcmpl", "completion": "cmpl", "response": "resp"}[api]
        head = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.model_name}
        builder = (ResponseBuilder((head["id"], f"msg-{uuid.uuid4().hex[:24]}"), head["created"], self.model_name,
                                   body) if api == "response" else None)
        # queued now: arrival order
        future = job.submit(self.batch) if self.batch else loop.run_in_executor(self.worker, job.run)
        if parsed.stream:
            events = self._stream_response(job, future, builder) if builder else self._stream(job, future, head)
            return StreamingResponse(events, media_type="text/event-stream")
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, job))
        try:
            results = await future
        except GrammarError as e:  # llguidance gave up on the request's grammar
            field = "text" if builder else "response_format"
            return error_response(400, f"{field}: {e}", field)
        except (RuntimeError, ValueError) as e:
            return error_response(500, f"generation failed: {e}", kind="server_error")
        finally:
            watcher.cancel()
        if results is None:  # its client left before it ran: nobody reads this
            return error_response(499, "the client closed the request")
        if builder:
            [result] = results
            logprobs = self._logprobs(_tokens(result), parsed)["content"] if parsed.logprobs else None
            calls = result.tool_calls or []
            return JSONResponse(builder.response(_status(result), result.text if result.text.strip() or not calls
                                                 else None, logprobs, response_usage(_usage(results)), calls))
        choices = []
        for i, result in enumerate(results):
            choice = {"index": i, "finish_reason": _finish_reason(result)}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
                if result.tool_calls:
                    choice["message"] = {"role": "assistant", "content": result.text.strip() or None,
                                         "tool_calls": [call.openai() for call in result.tool_calls]}
            else:
                choice["text"] = result.text
            choice["logprobs"] = self._logprobs(_tokens(result), parsed) if parsed.logprobs else None
            choices.append(choice)
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": choices, "usage": _usage(results)})

    @staticmethod
    async def _cancel_on_disconnect(request: Request, job: _Job) -> None:
        """A whole (not streamed) answer's client that leaves cancels it too."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled.set()

    async def _stream(self, job: _Job, future: asyncio.Future, head: dict):
        chat = job.request.chat
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(index: int, text: str | None, tokens=(), finish: str | None = None, offset: int = 0) -> str:
            choice = {"index": index, "finish_reason": finish,
                      "logprobs": self._logprobs(tokens, job.request, offset) if job.request.logprobs and tokens
                      else None}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["text"] = text or ""
            return _sse({**head, "choices": [choice]})

        try:
            if chat:
                yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}
                                                for i in range(len(job.request.plans))]})
            offsets = [0] * len(job.request.plans)
            while (item := await job.queue.get()) is not _DONE:
                index, piece, tokens = item
                if piece is None:  # the choice's end: tokens is its result
                    if tokens.tool_calls:  # each call whole, in one delta
                        yield _sse({**head, "choices": [{"index": index, "logprobs": None, "finish_reason": None,
                                                         "delta": {"tool_calls": [call.openai(j) for j, call in
                                                                                  enumerate(tokens.tool_calls)]}}]})
                    yield chunk(index, None, finish=_finish_reason(tokens))
                    continue
                yield chunk(index, piece, tokens, offset=offsets[index])
                offsets[index] += len(piece)
            try:
                results = await future
            except (RuntimeError, ValueError) as e:
                yield _sse({"error": {"message": f"generation failed: {e}", "type": "server_error",
                                      "param": None, "code": None}})
            else:
                if job.request.include_usage and results:
                    yield _sse({**head, "choices": [], "usage": _usage(results)})
            yield _sse("[DONE]")
        finally:
            job.cancelled.set()  # the client left (or all was sent): stop at the next token

    async def _stream_response(self, job: _Job, future: asyncio.Future, builder: ResponseBuilder):
        """The Responses API's events: opening ones, a delta per piece of
        text, closing ones (or response.failed)."""
        try:
            for event in builder.opening():
                yield event
            text, logprobs, opened = "", [], False
            while (item := await job.queue.get()) is not _DONE:
                _, piece, tokens = item
                if piece is None:  # the end of the one choice (its result comes from the future)
                    continue
                found = self._logprobs(tokens, job.request)["content"] if job.request.logprobs and tokens else []
                text += piece
                logprobs += found
                if piece or found:
                    if not opened:  # (an answer that is calls only has no message)
                        opened = True
                        for event in builder.message_opening():
                            yield event
                    yield builder.delta(piece, found)
            try:
                results = await future
            except (RuntimeError, ValueError) as e:
                failed = builder.response("failed")
                failed["error"] = {"code": "server_error", "message": f"generation failed: {e}"}
                yield builder.event("response.failed", response=failed)
            else:
                if results:
                    usage, calls = response_usage(_usage(results)), results[0].tool_calls or []
                    for event in builder.closing(_status(results[0]), text, logprobs, usage, calls, opened):
                        yield event
        finally:
            job.cancelled.set()  # the client left (or all was sent): stop at the next token

    def _logprobs(self, tokens, request: Request, offset: int = 0) -> dict:
        """OpenAI's logprobs of the chosen tokens, each with the request's
        number of most likely ones (an eos id has no text and is left out)."""
        decode = self.runner.tokenizer.decode
        k = request.top_logprobs
        kept = [(decode([t]), lp, [(decode([i]), v) for i, v in lp.top[:k]])
                for t, lp in tokens if t not in self.runner.eos_ids]
        if request.chat:
            def entry(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [{**entry(s, lp), "top_logprobs": [entry(*alt) for alt in top]}
                                for s, lp, top in kept]}
        offsets = []
        for s, _, _ in kept:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": [s for s, _, _ in kept], "token_logprobs": [lp for _, lp, _ in kept],
                "top_logprobs": [dict(top) for _, _, top in kept] if k else None, "text_offset": offsets}


def _finish_reason(result: GenerationResult) -> str:
    """`tool_calls` when the model called (unless the token limit cut a last call short)."""
    if result.tool_calls and result.stop_reason != "max_new_tokens":
        return "tool_calls"
    return FINISH_REASONS[result.stop_reason]


def _status(result: GenerationResult) -> str:
    """A Response's status: incomplete when the token limit ended it."""
    return "incomplete" if result.stop_reason == "max_new_tokens" else "completed"


def _tokens(result: GenerationResult) -> list[tuple[int, float | None]]:
    return list(zip(result.token_ids, result.logprobs or [None] * len(result.token_ids)))


def _usage(results: list[GenerationResult]) -> dict:
    """OpenAI's usage: the prompt once (its cache reuse the first choice's), every choice's tokens."""
    first = results[0]
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(exc.status_code, exc.detail or "error", code=str(exc.status_code))


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    """Our own bug: still OpenAI's body (the traceback goes to the log)."""
    return error_response(500, f"internal error: {type(exc).__name__}", kind="server_error")


def create_app(runner: LLMRunner, model_name: str, draft: dict | None = None,
               options: ServeOptions = ServeOptions()) -> Starlette:
    """`draft`: prepare()'s speculative-decoding keywords (draft,
    num_draft_tokens, adaptive_drafting) for every request but those with
    structured output, which decode plainly (the output is the same).
    `options`: the access policy and the limits on requests."""
    if runner.tokenizer is None:
        raise ValueError("the server needs the runner's tokenizer (pass tokenizer_dir)")
    if runner.max_batch > 1 and draft:
        raise ValueError("a batched program verifies no drafts: serve it without --draft")
    runner.chat_template  # loaded now, not by the first request
    runner.max_token_bytes  # measured now, not by the first request
    if runner.max_batch == 1:  # (a batched program keeps its rows' conversations: llm/run/batch.py)
        runner.use_prompt_cache(options.prompt_cache_bytes)
    server = Server(runner, model_name, draft or {}, options)
    return Starlette(routes=[
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
    ], middleware=access_middleware(options), exception_handlers={HTTPException: _http_error,
                                                                  Exception: _server_error})


def access_middleware(options: ServeOptions) -> list[Middleware]:
    """The guard (guard.py), then CORS where origins are allowed."""
    middleware = [Middleware(Guard, policy=options.policy)]
    if options.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    return middleware


def serve(pte: str, tokenizer_dir: str, options: ServeOptions = ServeOptions(), draft=None) -> None:
    """Loads the program, then serves it until interrupted. `draft(runner)`
    gives the speculative-decoding keywords of every request (see create_app)."""
    import uvicorn

    from .http_protocol import limited_protocol

    runner = LLMRunner(pte, tokenizer_dir)
    name = options.model_name or Path(pte).stem
    app = create_app(runner, name, draft(runner) if draft else None, options)
    if not options.quiet:
        access = "an API key" if options.api_key else "no API key (serve --api-key)"
        print(f"serving {name} on http://{options.host}:{options.port}/v1 (chat template: "
              f"{'yes' if runner.has_chat_template else 'none, /v1/completions only'}; {access})",
              file=sys.stderr, flush=True)
    uvicorn.run(app, host=options.host, port=options.port, log_level="warning" if options.quiet else "info",
                http=limited_protocol(options.header_timeout))
