"""`executorch-mlx chat`: a terminal conversation with a runner.

Each answer streams as it is sampled and ends with a line of its speed on
stderr. The conversation is rendered by the folder's chat template every
turn; the runner reuses the cache entries of what it already holds, so a
follow-up prefills only the new message. `/reset` starts over, `/exit` (or
end of input) quits.
"""

from __future__ import annotations

import sys

from .runner import LLMRunner

HELP = "/reset starts a new conversation, /exit quits"


def chat_loop(runner: LLMRunner, system_prompt: str | None, max_new_tokens: int, sampling: dict,
              read=input, out=sys.stdout, err=sys.stderr) -> int:
    if not runner.has_chat_template:
        raise ValueError(f"chat needs a chat template; {runner.tokenizer_dir} has none (use generate)")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be positive, got {max_new_tokens}")
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
        ids = runner.chat_prompt(turn, system_prompt)
        room = runner.max_context - len(ids)
        if room < 1:
            print(f"the conversation fills this program's context ({runner.max_context} tokens): /reset",
                  file=err, flush=True)
            continue
        result = runner.generate(ids, max_new_tokens=min(max_new_tokens, room),
                                 on_text=lambda text: print(text, end="", flush=True, file=out), **sampling)
        print(file=out, flush=True)
        print(f"[{len(result.token_ids)} tokens, {result.decode_tokens_per_s:.1f} tokens/s; "
              f"{result.cached_tokens} of {result.prompt_tokens} prompt tokens reused]", file=err, flush=True)
        messages = turn + [{"role": "assistant", "content": result.text}]
