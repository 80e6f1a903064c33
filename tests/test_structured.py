"""Structured output (llm/run/grammar.py): a grammar's mask applied by the
program's sampler. The model has random weights, so any output that parses
is a property of the mask, not of the model; many seeds at T = 1 say so.
The mask's exactness on each device path is in test_sampler.py."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
from cli_runs import cli
from container_fuzz import MAX_CONTEXT, export_program
from llm_programs import family_program

from executorch_mlx.llm.export.hf_export import metadata
from executorch_mlx.llm.run.runner import LLMRunner

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
LARK = r"""
start: pair ("," pair)?
pair: KEY "=" VALUE
KEY: /[a-z]{1,4}/
VALUE: /[0-9]{1,2}/
"""


@pytest.fixture(scope="module")
def program(shared):
    """(.pte, folder): the tiny all-bytes Llama (any text is some token
    sequence), sampling, exported with its token mask input (the default)."""
    return shared.get("tiny-llama", export_program)


@pytest.fixture(scope="module")
def runner(program):
    return LLMRunner(*program)


def test_json_schema_outputs_validate(runner):
    for seed in range(12):
        result = runner.generate("Hi", max_new_tokens=MAX_CONTEXT - 4, temperature=1.0, seed=seed, json_schema=SCHEMA)
        jsonschema.validate(json.loads(result.text), SCHEMA)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', result.text)
        assert not re.search(r"\s", outside_strings), result.text  # compact: no free whitespace
        assert result.stop_reason in ("grammar", "eos"), result


def test_regex_outputs_fully_match(runner):
    pattern = r"[a-c]{2,5}-[0-9]{3}"
    for seed in range(8):
        result = runner.generate("Hi", max_new_tokens=20, temperature=1.0, seed=seed, regex=pattern)
        assert re.fullmatch(pattern, result.text), result.text
        assert result.stop_reason == "grammar"


def test_lark_grammar_outputs_parse(runner, tmp_path):
    parser = lark.Lark(LARK)
    path = tmp_path / "pairs.lark"
    path.write_text(LARK)
    for seed in range(8):
        grammar = path if seed % 2 else LARK  # a file or the text
        result = runner.generate("Hi", max_new_tokens=20, temperature=1.0, seed=seed, grammar=grammar)
        parser.parse(result.text)


def test_greedy_decoding_takes_the_grammar_too(runner):
    result = runner.generate("Hi", max_new_tokens=20, temperature=0.0, regex=r"(yes|no)")
    assert result.text in ("yes", "no") and result.stop_reason == "grammar"


def test_a_mask_that_leaves_no_finite_logit_is_a_clear_error(runner):
    a = runner.tokenizer.token_to_id("a")
    with pytest.raises(RuntimeError, match=r"no valid token \(id -1\): the grammar allows no token whose logit is "
                                           r"finite here"):
        runner.generate("Hi", max_new_tokens=4, temperature=1.0, regex="a", logit_bias={a: float("-inf")})


def test_bad_grammars_and_programs_without_a_mask_are_refused(runner, shared):
    with pytest.raises(ValueError, match="give at most one of json_schema, regex and grammar"):
        runner.generate("Hi", regex="a", grammar="start: \"a\"")
    with pytest.raises(ValueError, match="the JSON schema is not valid JSON"):
        runner.generate("Hi", json_schema="{not json")
    with pytest.raises(ValueError, match="the grammar is not valid"):
        runner.generate("Hi", grammar="start: undefined_rule")
    folder, logits_only = family_program(shared, "llama", sampling=False)
    with pytest.raises(ValueError, match="this program takes no token mask"):
        LLMRunner(logits_only, folder).generate("Hi", regex="a")


def test_no_grammar_exports_leave_the_mask_input_out():
    config = {"vocab_size": 64, "model_type": "llama"}
    with_mask = metadata(config, 16, 15, True, "none")["emlx_input_names"].split(",")
    without = metadata(config, 16, 15, True, "none", token_mask=False)["emlx_input_names"].split(",")
    assert with_mask[-1] == "token_bitmask" and without == with_mask[:-1]


def test_cli_generate_with_a_json_schema(program, capfd):
    pte, folder = program
    done = cli(capfd, "generate", pte, "--tokenizer", folder, "--prompt", "Hi", "--temperature", "1", "--seed", "3",
               "--max-new-tokens", MAX_CONTEXT - 4, "--json-schema", json.dumps(SCHEMA), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["stop_reason"] in ("grammar", "eos")


def test_ids_past_the_tokenizer_are_never_allowed(program, tmp_path):
    """A model vocabulary padded beyond its tokenizer's (as Qwen2.5's is): the
    mask never allows an id the tokenizer does not have."""
    import shutil

    import torch

    from executorch_mlx.custom_kernel_ops.sample import allowed_by
    from executorch_mlx.llm.model_folders import train_tokenizer

    pte, folder = program
    small = shutil.copytree(folder, tmp_path / "small")
    train_tokenizer(vocab_size=300, all_bytes=True).save(str(small / "tokenizer.json"))
    runner = LLMRunner(pte, small)
    allowed = allowed_by(torch.from_numpy(runner.constraint(regex=r"(?s:.{1,8})").mask()), runner.vocab_size)[0]
    assert runner.vocab_size == 384 and allowed[:300].sum() > 100 and not allowed[300:].any()


def test_response_format_json_object_gives_an_object(runner):
    """The server's mapping (serve/requests.py), run in process on this
    tokenizer, which spells braces (test_serve.py's does not)."""
    from executorch_mlx.serve.requests import parse

    for seed in range(4):
        request = parse({"prompt": "Hi", "response_format": {"type": "json_object"}, "seed": seed,
                         "max_tokens": MAX_CONTEXT - 4}, runner, chat=False)
        assert request.plans[0].constraint is not None
        result = runner.run(request.plans[0])
        # an object without a schema may outgrow max_tokens: then it is one cut short
        if result.stop_reason == "max_new_tokens":
            assert result.text.startswith("{"), result.text
        else:
            assert isinstance(json.loads(result.text), dict), result.text


def test_a_plan_is_prepared_once_and_runs_once(runner, program):
    """The server's parse prepares the runner's Plan (the grammar compiled
    there, once); the job runs that plan; a plan cannot run twice, nor on
    another runner (its matcher has advanced)."""
    from executorch_mlx.serve.requests import parse

    request = parse({"prompt": "Hi", "response_format": {"type": "json_object"}, "seed": 3, "max_tokens": 8},
                    runner, chat=False)
    constraint = request.plans[0].constraint
    result = runner.run(request.plans[0])
    assert constraint.matcher.is_stopped() or len(result.token_ids) == 8  # this plan's matcher advanced
    with pytest.raises(ValueError, match="runs once"):
        runner.run(request.plans[0])
    other = LLMRunner(*program)
    with pytest.raises(ValueError, match="another runner"):
        other.run(runner.prepare("Hi", max_new_tokens=2))
    again = runner.generate("Hi", max_new_tokens=8, temperature=1.0, seed=3, json_schema={"type": "object"})
    assert again.token_ids == result.token_ids  # prepare + run is generate (OpenAI's default temperature 1)
