"""The `executorch-mlx` command line.

    executorch-mlx demo                                  a small LLM: build, export, generate
    executorch-mlx export MODEL_DIR -o FILE.pte          Hugging Face folder -> .pte
    executorch-mlx generate FILE.pte --tokenizer MODEL_DIR --prompt TEXT
    executorch-mlx chat FILE.pte --tokenizer MODEL_DIR   an interactive, multi-turn chat
    executorch-mlx serve FILE.pte --tokenizer MODEL_DIR  an OpenAI-compatible HTTP server
    executorch-mlx inspect FILE.pte                      print the MLX delegate graphs
    executorch-mlx --version                             versions and the device MLX will use

Progress goes to stderr (a live bar on a terminal; --quiet: none); known
warnings of our dependencies are hidden (--verbose: shown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .serialization.sampler_params import ROW_PARAMS, SAMPLER_INPUTS

API_KEY_VARIABLE = "EXECUTORCH_MLX_API_KEY"


def cmd_inspect(args) -> int:
    from .inspector import inspect_pte

    print(inspect_pte(args.pte))
    return 0


def cmd_export(args) -> int:
    from .llm.export.hf_export import export_llm
    from .llm.export.options import ExportOptions
    from .progress import TerminalProgress, shown_by

    options = ExportOptions(max_context=args.max_context, dtype=args.dtype, sampling=not args.no_sampling,
                            quantize=args.quantize, group_size=args.group_size,
                            quantize_embedding=args.quantize_embedding, history_size=args.history_size,
                            logit_bias_size=args.logit_bias_size, logprobs=args.logprobs,
                            top_logprobs=args.top_logprobs, token_mask=not args.no_grammar,
                            allow_longer_context=args.allow_longer_context, max_draft_tokens=args.max_draft_tokens,
                            activations=args.activations, scales_dtype=args.scales_dtype,
                            external_weights=args.external_weights,
                            max_batch=args.max_batch)
    display = None if args.quiet else TerminalProgress(sys.stderr)
    with display or contextlib.nullcontext(), shown_by(display):
        export_llm(args.model_dir, args.output, options, progress=display and display.line)
    return 0


def sampler_kwargs(args) -> dict:
    """generate()'s sampling keywords from the sampler flags."""
    return dict(temperature=args.temperature, seed=args.seed, repetition_context_size=args.repetition_context_size,
                logit_bias=dict(args.logit_bias) or None, stop=args.stop or None,
                **{name: getattr(args, name) for name in ROW_PARAMS})


def draft_kwargs(args, runner) -> dict:
    """generate()'s speculative-decoding keywords from the draft flags,
    checked against the target `runner` now (before any prompt runs)."""
    from .llm.run.drafting import PromptLookup
    from .llm.run.runner import LLMRunner

    if args.draft_model and args.prompt_lookup:
        raise ValueError("--draft-model and --prompt-lookup are two drafters: give one")
    draft = LLMRunner(args.draft_model) if args.draft_model else PromptLookup.name if args.prompt_lookup else None
    runner.drafter(draft, args.num_draft_tokens)
    if draft is None:
        return {}
    return dict(draft=draft, num_draft_tokens=args.num_draft_tokens, adaptive_drafting=not args.fixed_draft_length)


def cmd_generate(args) -> int:
    from .llm.run.runner import LLMRunner

    runner = LLMRunner(args.pte, args.tokenizer)
    stream = None if args.json else (lambda text: print(text, end="", flush=True))
    options = dict(max_new_tokens=args.max_new_tokens, on_text=stream, json_schema=args.json_schema,
                   regex=args.regex, grammar=args.grammar and Path(args.grammar), **sampler_kwargs(args),
                   **draft_kwargs(args, runner))
    if runner.has_chat_template and not args.ignore_chat_template:
        result = runner.chat([{"role": "user", "content": args.prompt}], args.system_prompt, **options)
    elif args.system_prompt is not None:
        raise ValueError("--system-prompt needs a chat template: the tokenizer folder has none, or "
                         "--ignore-chat-template was given")
    else:
        result = runner.generate(args.prompt, **options)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text, "logprobs": result.logprobs,
                          "stop_reason": result.stop_reason,
                          "prefill_tokens_per_s": result.prefill_tokens_per_s,
                          "decode_tokens_per_s": result.decode_tokens_per_s,
                          "draft_tokens": result.draft_tokens, "accepted_tokens": result.accepted_tokens}))
    else:
        print()
        drafts = (f"; {result.accepted_tokens} of {result.draft_tokens} draft tokens accepted"
                  if result.draft_tokens else "")
        print(f"prefill {result.prefill_tokens_per_s:.1f} tokens/s, decode {result.decode_tokens_per_s:.1f} "
              f"tokens/s ({len(result.token_ids)} tokens, stopped at {result.stop_reason}{drafts})", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from .llm.run.chat_loop import ChatSettings, chat_loop
    from .llm.run.runner import LLMRunner

    tools = _read_json(args.tools, "--tools") if args.tools else None
    choice = args.tool_choice
    if choice not in (None, "auto", "none", "required"):  # a function's name
        choice = {"type": "function", "function": {"name": choice}}
    runner = LLMRunner(args.pte, args.tokenizer)
    return chat_loop(runner, ChatSettings(args.system_prompt, args.max_new_tokens,
                                          {**sampler_kwargs(args), **draft_kwargs(args, runner)}, tools, choice))


def _read_json(path: str, flag: str):
    """A JSON file's value, read no further than a grammar's size (it becomes one)."""
    from .llm.run.grammar import read_text_file

    try:
        text = read_text_file(path, flag.lstrip("-"))
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {path} is not JSON: {e}") from None


def cmd_serve(args) -> int:
    import os

    from .serve.app import ServeOptions, serve

    limits = {name: getattr(args, name) for name in ("max_request_bytes", "header_timeout")
              if getattr(args, name) is not None}  # (else ServeOptions' defaults)
    if any(v <= 0 for v in limits.values()):
        raise ValueError("--max-request-bytes and --header-timeout must be positive")
    if args.prompt_cache_bytes is not None:
        if args.prompt_cache_bytes < 0:
            raise ValueError("--prompt-cache-bytes must be >= 0")
        limits["prompt_cache_bytes"] = args.prompt_cache_bytes
    options = ServeOptions(host=args.host, port=args.port, model_name=args.model_name, quiet=args.quiet,
                           api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                           allowed_hosts=_names(args.allowed_hosts), allowed_origins=_names(args.allowed_origins),
                           **limits)
    serve(args.pte, args.tokenizer, options, draft=lambda runner: draft_kwargs(args, runner))
    return 0


def _names(values: list[str]) -> tuple[str, ...]:
    """Repeatable, comma-separated, case-insensitive names: ["A,b", "c"] -> (a, b, c)."""
    return tuple(n.strip().lower() for v in values for n in v.split(",") if n.strip())


def cmd_demo(args) -> int:
    import tempfile

    from .inspector import delegate_blobs
    from .llm.export.hf_export import export_llm
    from .llm.export.options import ExportOptions
    from .llm.model_folders import write_model_folder
    from .llm.run.runner import LLMRunner
    from .serialization import ir

    with tempfile.TemporaryDirectory() as tmp:
        print("== 1. A Llama-family model folder: random weights, a tokenizer trained just now ==")
        folder = write_model_folder(f"{tmp}/model", "llama", layers=4, hidden=256, heads=8, kv_heads=2,
                                    intermediate=512)
        print(f"{folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")

        print("\n== 2. Export: the KV cache and the sampler inside one MLX delegate ==")
        pte = export_llm(folder, f"{tmp}/model.pte", ExportOptions(max_context=256))
        for method, i, backend_id, blob in delegate_blobs(pte.read_bytes()):
            g = ir.deserialize(blob)
            print(f"delegate {i} of '{method}' -> {backend_id}: {len(g.nodes)} nodes, {len(g.constants)} weights, "
                  f"{len(g.mutable_buffers)} buffers kept between calls")

        print("\n== 3. Generate: prefill in one call, decode on the device, text streamed ==")
        runner = LLMRunner(pte, folder)
        for temperature, seed in ((0.0, None), (0.8, 42), (0.8, 42)):
            label = "greedy" if temperature <= 0 else f"temperature {temperature}, seed {seed}"
            print(f"[{label}] ", end="")
            result = runner.generate("Once upon a time", max_new_tokens=args.max_new_tokens,
                                     temperature=temperature, seed=seed,
                                     on_text=lambda text: print(text, end="", flush=True))
            print(f"\n  -> {len(result.token_ids)} tokens; prefill {result.prefill_tokens_per_s:.0f} tokens/s, "
                  f"decode {result.decode_tokens_per_s:.0f} tokens/s")
        print("(random weights: the text is noise; the same seed gives the same tokens)")
    return 0


def _bias_entry(text: str) -> tuple[int, float]:
    token, sep, value = text.partition("=")
    try:
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=VALUE (e.g. 13=-inf), got {text!r}") from None


class _PrintVersions(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from .versions import version_report

        print(version_report())
        parser.exit()


def _add_sampler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=None, help="64-bit sampling seed (default 0)")
    for spec in SAMPLER_INPUTS:  # the sampler table's flags: temperature and the row parameters, off by default
        if spec.cli:
            p.add_argument(spec.cli, dest=spec.name, type=int if spec.integer else float, default=spec.off,
                           help=spec.help)
    p.add_argument("--repetition-context-size", type=int, default=20,
                   help="recent tokens the penalties count (default 20)")
    p.add_argument("--logit-bias", type=_bias_entry, action="append", default=[], metavar="ID=VALUE",
                   help="add VALUE to token ID's logit (-inf bans it); repeatable")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before TEXT (never shown); repeatable")


def _add_draft_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, metavar="DRAFT.pte",
                   help="speculative decoding: a smaller program of the same tokenizer drafts tokens that the "
                        "program verifies (the output is plain decoding's)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding: draft the tokens that followed the last words where they occurred "
                        "before in the prompt or output")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="draft at most K tokens a round (default: the program's --max-draft-tokens)")
    p.add_argument("--fixed-draft-length", action="store_true",
                   help="always draft K tokens (default: fewer, or none for a while, when few are accepted)")


def _add_output_options(parser: argparse.ArgumentParser, default) -> None:
    """--verbose/--quiet, before the command or after it. After it they default
    to SUPPRESS: a subparser's default would overwrite the top-level value."""
    parser.add_argument("--verbose", action="store_true", default=default,
                        help="also show the known warnings of torch, transformers and torchao")
    parser.add_argument("--quiet", action="store_true", default=default,
                        help="no progress lines or bars on stderr")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="executorch-mlx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_PrintVersions,
                        help="print the versions of this package, ExecuTorch, MLX and torch, and MLX's device")
    _add_output_options(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="build a small Llama folder, export it and generate text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("export", help="export a Hugging Face model folder to a .pte")
    p.add_argument("model_dir", help="folder with config.json and *.safetensors (a Hugging Face or mlx-lm folder), "
                                     "or a llama.cpp .gguf file")
    p.add_argument("-o", "--output", required=True, help="the .pte to write")
    p.add_argument("--max-context", type=int, default=256, help="KV cache length in tokens (default 256)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="weights and compute type")
    p.add_argument("--no-sampling", action="store_true",
                   help="return logits (runs in ExecuTorch's TextLLMRunner) instead of sampled token ids")
    p.add_argument("--quantize", metavar="int2..int8|mxfp4", default=None,
                   help="store linear weights 2-, 3-, 4-, 5-, 6- or 8-bit (int2 ... int8) in MLX's affine layout, "
                        "or as MXFP4 (4-bit floats, a power-of-two scale per 32) (default: not quantized)")
    p.add_argument("--group-size", type=int, default=None, metavar="32|64|128",
                   help="values per scale and bias when quantizing (default 64; mxfp4: 32, its only size)")
    p.add_argument("--quantize-embedding", action=argparse.BooleanOptionalAction, default=None,
                   help="with --quantize: the input embedding table (and an output layer tied to it) quantized too "
                        "(default: when its type and width allow; --no-quantize-embedding keeps it at --dtype)")
    p.add_argument("--scales-dtype", choices=["bf16", "dtype"], default=None,
                   help="with --quantize int2..int8: scales and biases stored as bfloat16 (4.5 bits a weight at "
                        "group 64, not 5) or in --dtype (exactly MLX's quantize) (default: bf16; dtype for fp16)")
    p.add_argument("--activations", choices=["int8", "float"], default=None,
                   help="how 4- and 8-bit layers meet x on CPUs: int8 (rounded to 8 bits per group, as llama.cpp "
                        "does: faster) or float (times the dequantized weights, as mlx-lm does) (default: float "
                        "for an mlx-lm folder, else int8)")
    p.add_argument("--external-weights", action="store_true",
                   help="write the weights to an ExecuTorch data file beside the program (FILE.pte: FILE.ptd), "
                        "which generate, chat, serve and emlx_runner load with it")
    p.add_argument("--history-size", type=int, default=64,
                   help="tokens of history the repetition/frequency/presence penalties can count (default 64)")
    p.add_argument("--logit-bias-size", type=int, default=16,
                   help="tokens a generate call can give a logit bias (default 16)")
    p.add_argument("--logprobs", action="store_true", help="also return each token's log-probability")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                   help="also return the K most likely tokens and their log-probabilities at each step "
                        "(at most 20; implies --logprobs; serve's top_logprobs)")
    p.add_argument("--no-grammar", action="store_true",
                   help="leave out the token mask input that structured output (generate --json-schema, "
                        "--regex, --grammar) fills")
    p.add_argument("--allow-longer-context", action="store_true",
                   help="allow --max-context above the model's max_position_embeddings (positions never trained)")
    p.add_argument("--max-draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens one call can verify (speculative decoding; 0: none; default 8, at most 15; "
                        "0 with --max-batch)")
    p.add_argument("--max-batch", type=int, default=1, metavar="N",
                   help="run up to N sequences per call, each in its own cache row (serve batches requests "
                        "continuously on it; default 1)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("inspect", help="print the MLX delegate graphs of a .pte")
    p.add_argument("pte")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("generate", help="generate text with a .pte made by `executorch-mlx export`")
    p.add_argument("pte")
    p.add_argument("--tokenizer", required=True, help="the model folder (its tokenizer.json), or the .gguf file")
    p.add_argument("--prompt", required=True,
                   help="the prompt text (a user message under the folder's chat template, if it has one)")
    p.add_argument("--system-prompt", default=None, help="a system message before the prompt (chat template)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="feed the prompt as it is, even when the folder has a chat template")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    _add_sampler_flags(p)
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                            help="output JSON that matches this schema (compact, no free whitespace)")
    structured.add_argument("--regex", default=None, metavar="PATTERN", help="output that fully matches PATTERN")
    structured.add_argument("--grammar", default=None, metavar="FILE",
                            help="output in the language of this Lark grammar (a .lark file)")
    _add_draft_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: token_ids, text, stop_reason, prefill/decode tokens per second, "
                        "draft_tokens and accepted_tokens")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("chat", help="an interactive chat (streamed, multi-turn, the KV cache reused)")
    p.add_argument("pte")
    p.add_argument("--tokenizer", required=True,
                   help="the model folder (tokenizer.json and a chat template), or the .gguf file")
    p.add_argument("--system-prompt", default=None, help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--tools", default=None, metavar="FILE.json",
                   help="functions the model may call (OpenAI's tools list); you type each call's result")
    p.add_argument("--tool-choice", default=None, metavar="auto|none|required|NAME",
                   help="auto (default): the model decides; required or a function's name: a call is forced")
    _add_sampler_flags(p)
    _add_draft_flags(p)
    p.set_defaults(fn=cmd_chat)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    p.add_argument("pte")
    p.add_argument("--tokenizer", required=True, help="the model folder (tokenizer.json, a chat template) or .gguf")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--model-name", default=None, help="the model's id in requests and /v1/models "
                                                      "(default: the .pte's file name without .pte)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_VARIABLE}; "
                        f"none: no key needed)")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME]",
                   help="Host header names answered besides the --host address and localhost ('*': any); "
                        "repeatable")
    p.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN]",
                   help="web origins (https://app.example) whose pages may call the server, CORS ('*': any; "
                        "default: none); repeatable")
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="the largest request body taken (default 8 MiB; larger: 413)")
    p.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection whose request headers take longer (default 10)")
    p.add_argument("--prompt-cache-bytes", type=int, default=None, metavar="N",
                   help="keep other conversations' KV caches for their next turns, up to N bytes of them "
                        "(default 2 GiB; 0: keep only the last one's)")
    _add_draft_flags(p)
    p.set_defaults(fn=cmd_serve)
    for command in sub.choices.values():
        _add_output_options(command, argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.verbose:
        from .third_party_warnings import hide_known_warnings

        hide_known_warnings()
    from ._runtime_library import clear_last_error, last_error

    clear_last_error()
    try:
        return args.fn(args)
    except (ValueError, OSError, RuntimeError) as e:
        message = str(e)
        reason = last_error()
        if isinstance(e, RuntimeError) and reason and reason not in message:
            # ExecuTorch's own message is an error code; ours says why
            message += f" ({reason})"
        # one line, whatever the exception's text
        print(f"executorch-mlx {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
