"""`executorch-mlx chat`: a terminal conversation with a runner.

Each answer streams as it is sampled and ends with a line of its speed on
stderr. The conversation is rendered by the folder's chat template every
turn; the runner reuses the cache entries of what it already holds, so a
follow-up prefills only the new message. `/reset` starts over, `/exit` (or
end of input) quits.

With tools (`--tools FILE.json`, OpenAI's list), a call the model makes is
printed (`[call NAME {arguments}]`) and the loop asks for its result, which
goes back to the model as the tool's message; the model then answers again
(a forced `--tool-choice` forces the first answer of each turn only).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .runner import LLMRunner

HELP = "/reset starts a new conversation, /exit quits"


@dataclass(frozen=True)
class ChatSettings:
    """The `chat` command's flags: each answer's limits, sampler and tools."""

    system_prompt: str | None = None
    max_new_tokens: int = 256
    sampling: dict = field(default_factory=dict)  # generate()'s keywords
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


def chat_loop(runner: LLMRunner, settings: ChatSettings, read=input, out=sys.stdout, err=sys.stderr) -> int:
    if not runner.has_chat_template:
        raise ValueError(f"chat needs a chat template; {runner.tokenizer_dir} has none (use generate)")
    if settings.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be positive, got {settings.max_new_tokens}")
    use = runner.tool_use(settings.tools, settings.tool_choice)  # checked before the first turn
    # a forced call is the first answer of a turn; the model decides after the results
    then = runner.tool_use(settings.tools, "auto") if use is not None and use.grammar else use
    print(f"{HELP}.", file=err, flush=True)
    messages: list[dict] = []
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            print(file=out)
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = []
            print("(a new conversation)", file=err, flush=True)
            continue
        if not line:
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}: {HELP}", file=err, flush=True)
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            answers = 0
            while (answer := _answer(runner, settings, then if answers else use, turn, out, err)) is not None:
                turn, answers = turn + answer, answers + 1
                if not answer[0].get("tool_calls"):
                    break
                turn += _tool_results(answer[0]["tool_calls"], read)
        except EOFError:
            print(file=out)
            return 0
        if answers:  # (a message that found no room is not kept)
            messages = turn


def _answer(runner: LLMRunner, settings: ChatSettings, use, turn: list[dict], out, err) -> list[dict] | None:
    """The assistant's message after `turn`, streamed (None: no room left)."""
    ids = runner.chat_prompt(turn, settings.system_prompt, use and use.tools)
    room = runner.max_context - len(ids)
    if room < 1:
        print(f"the conversation fills this program's context ({runner.max_context} tokens): /reset",
              file=err, flush=True)
        return None
    result = runner.generate(ids, max_new_tokens=min(settings.max_new_tokens, room), tool_use=use,
                             on_text=lambda text: print(text, end="", flush=True, file=out), **settings.sampling)
    for call in result.tool_calls or []:
        print(f"[call {call.name} {call.arguments}]", file=out, flush=True)
    print(file=out, flush=True)
    print(f"[{len(result.token_ids)} tokens, {result.decode_tokens_per_s:.1f} tokens/s; "
          f"{result.cached_tokens} of {result.prompt_tokens} prompt tokens reused]", file=err, flush=True)
    message = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [call.openai() for call in result.tool_calls]
    return [message]


def _tool_results(calls: list[dict], read) -> list[dict]:
    """Each call's result, as the user types it, as a tool message."""
    results = []
    for call in calls:
        text = read(f"{call['function']['name']} result> ")
        results.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                        "content": text})
    return results
