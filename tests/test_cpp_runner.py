"""The C++ runner (runtime/llm_runner.cpp, installed as emlx_runner) gives
exactly the ids of the Python LLMRunner on the same .pte, prompt and seed.
(The README's C++ test runs it on an int4 program: tests/test_documented_commands.py.)"""

from __future__ import annotations

import subprocess

import pytest
from llm_programs import MAX_CONTEXT, family_program

import executorch_mlx
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = [5, 17, 42, 8, 99, 3, 61]


@pytest.fixture(scope="module")
def programs(shared):
    """The Llama family programs tests/test_llm.py runs too (the sampled one
    also returns log-probabilities, which the C++ runner reads past)."""
    return {"sampled": family_program(shared, "llama")[1], "logits": family_program(shared, "llama", False)[1]}


def cpp(pte, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(executorch_mlx.runner_binary()), str(pte), *args], capture_output=True, text=True)


def cpp_ids(pte, prompt, new, temperature=0.0, seed=0, *flags: str) -> list[int]:
    done = cpp(pte, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(new),
               "--temperature", str(temperature), "--seed", str(seed), *flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ids: ") and "tokens/s" in lines[1] and "tokens/s" in lines[2], done.stdout
    return [int(i) for i in lines[0].split()[1:]]


@pytest.mark.parametrize("case,temperature,seed", [("sampled", 0.9, 7), ("sampled", 0.9, 2**64 - 5),
                                                   ("sampled", 0.0, 0), ("logits", 0.0, 0)])
def test_cpp_runner_ids_equal_python_runner(programs, case, temperature, seed):
    want = LLMRunner(programs[case]).generate(PROMPT, max_new_tokens=8, temperature=temperature, seed=seed)
    assert cpp_ids(programs[case], PROMPT, 8, temperature, seed) == want.token_ids


# (Python runner keywords, the same as C++ runner flags)
SAMPLERS = [
    (dict(top_k=5, top_p=0.8), ["--top-k", "5", "--top-p", "0.8"]),
    (dict(min_p=0.1, repetition_penalty=1.5, repetition_context_size=6),
     ["--min-p", "0.1", "--repetition-penalty", "1.5", "--repetition-context-size", "6"]),
    (dict(frequency_penalty=0.7, presence_penalty=0.4, logit_bias={5: 3.0, 17: float("-inf")}),
     ["--frequency-penalty", "0.7", "--presence-penalty", "0.4", "--logit-bias", "5=3", "--logit-bias", "17=-inf"]),
]


@pytest.mark.parametrize("kwargs,flags", SAMPLERS, ids=["top-k+top-p", "min-p+repetition", "penalties+bias"])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_cpp_runner_sampler_flags_equal_python_runner(programs, kwargs, flags, temperature):
    want = LLMRunner(programs["sampled"]).generate(PROMPT, max_new_tokens=8, temperature=temperature, seed=3,
                                                       **kwargs)
    assert cpp_ids(programs["sampled"], PROMPT, 8, temperature, 3, *flags) == want.token_ids
    if "logit_bias" in kwargs:
        assert 17 not in want.token_ids


@pytest.mark.parametrize("args,message", [
    ([], "--prompt-ids is required"),
    (["--prompt-ids", "1,x"], "--prompt-ids: expected an integer, got 'x'"),
    (["--prompt-ids", "1", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--prompt-ids", "1", "--bogus"], "unknown option --bogus"),
    (["--prompt-ids", "1", "--max-new-tokens", str(MAX_CONTEXT)], f"exceeds the max context of {MAX_CONTEXT}"),
    (["--prompt-ids", "100000", "--max-new-tokens", "2"], "prompt token ids must be in [0, "),
    (["--prompt-ids", "1", "--temperature", "0.5", "--seed", "1.5"], "--seed: expected a 64-bit integer"),
    (["--prompt-ids", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--min-p", "1"], "--min-p must be in [0, 1)"),
    (["--prompt-ids", "1", "--top-k", "-2"], "--top-k must be >= 0"),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--repetition-penalty", "1.2", "--repetition-context-size", "65"],
     "exceeds this program's history of 64 tokens"),
    (["--prompt-ids", "1", "--logit-bias", "3"], "--logit-bias: expected ID=VALUE"),
    (["--prompt-ids", "1", "--max-new-tokens", "2", "--logit-bias", "100000=1"], "--logit-bias: token ids must be in [0, "),
    (["--prompt-ids", "1", "--memory-budget-kib", "0"], "--memory-budget-kib must be in [1, 2^31)"),
    (["--prompt-ids", "1", "--prompt-lookup", "--draft-model", "d.pte"], "two drafters: give one"),
    (["--prompt-ids", "1", "--num-draft-tokens", "2"], "--num-draft-tokens needs a drafter"),
    (["--prompt-ids", "1", "--prompt-lookup", "--num-draft-tokens", "9"], "--num-draft-tokens must be in [1, 8]"),
])
def test_cpp_runner_bad_arguments(programs, args, message):
    done = cpp(programs["sampled"], *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("drafter", [["--prompt-lookup"], ["--draft-model", "TARGET"],
                                     ["--draft-model", "TARGET", "--num-draft-tokens", "3", "--fixed-draft-length"]])
def test_cpp_runner_drafts_give_plain_ids(programs, drafter):
    """Speculative decoding in C++: the Python runner's plain ids; the
    target's own program as the draft model accepts every draft. The
    drafting policy is one (the generated contract's numbers): the C++
    runner drafts and accepts exactly as many tokens as the Python one."""
    pte = programs["sampled"]
    kwargs, flags = SAMPLERS[1]
    prompt = PROMPT * 3
    python = LLMRunner(pte)
    want = python.generate(prompt, max_new_tokens=16, temperature=1.3, seed=3, **kwargs).token_ids
    drafting = {"draft": "prompt-lookup"} if "--prompt-lookup" in drafter else {"draft": LLMRunner(pte)}
    if "--num-draft-tokens" in drafter:
        drafting.update(num_draft_tokens=3, adaptive_drafting=False)
    drafted_in_python = python.generate(prompt, max_new_tokens=16, temperature=1.3, seed=3, **kwargs, **drafting)
    done = cpp(pte, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "16", "--temperature", "1.3",
               "--seed", "3", *flags, *[str(pte) if f == "TARGET" else f for f in drafter])
    assert done.returncode == 0, done.stderr
    ids, _, _, drafts = done.stdout.splitlines()
    assert [int(i) for i in ids.split()[1:]] == want == drafted_in_python.token_ids
    drafted, accepted = (int(w) for w in drafts.split()[1::2])
    assert drafted > 0 and (accepted == drafted if "TARGET" in drafter else accepted <= drafted)
    assert (drafted, accepted) == (drafted_in_python.draft_tokens, drafted_in_python.accepted_tokens)


def test_cpp_runner_greedy_only_on_a_logits_program(programs):
    for flags in (["--temperature", "0.5"], ["--top-k", "3"]):
        done = cpp(programs["logits"], "--prompt-ids", "1", "--max-new-tokens", "2", *flags)
        assert done.returncode == 2 and "only greedy decoding" in done.stderr
    done = cpp(programs["logits"], "--prompt-ids", "1", "--max-new-tokens", "2", "--prompt-lookup")
    assert done.returncode == 2 and "verifies no drafts" in done.stderr


def test_cpp_runner_refuses_a_missing_or_foreign_file(programs, tmp_path):
    done = cpp(tmp_path / "missing.pte", "--prompt-ids", "1")
    assert done.returncode == 1 and "opening" in done.stderr and "missing.pte" in done.stderr
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"not a program" * 10)
    done = cpp(bad, "--prompt-ids", "1")
    assert done.returncode == 1 and "bad.pte is not an ExecuTorch program" in done.stderr


def test_cpp_runner_memory_budget_is_a_load_option_of_the_program(programs):
    """--memory-budget-kib passes the backend's load-time option: a budget
    below the program's KV cache refuses it at load, naming both sizes; a
    large one runs it."""
    args = ["--prompt-ids", "1,2", "--max-new-tokens", "2"]
    done = cpp(programs["logits"], *args, "--memory-budget-kib", "1")
    assert done.returncode == 1, done.stderr
    assert "mutable buffers of" in done.stderr and "exceed the memory budget of 1024 bytes" in done.stderr
    assert "loading method 'forward'" in done.stderr
    assert cpp_ids(programs["logits"], [1, 2], 2) == cpp_ids(programs["logits"], [1, 2], 2, 0.0, 0,
                                                             "--memory-budget-kib", str(1 << 20))


def test_weights_in_a_data_file_beside_the_program(programs, shared, tmp_path, capsys):
    """export --external-weights: the weights go to model.ptd beside model.pte
    (the program keeps none of them), both runners load them from there or
    from a path given, and give the ids of the program that holds its
    weights; a missing or unwanted data file is named."""
    from executorch_mlx.cli import main
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    folder, inside = family_program(shared, "llama")
    pte = export_llm(folder, tmp_path / "model.pte",
                     ExportOptions(max_context=MAX_CONTEXT, logprobs=True, external_weights=True), progress=None)
    data = tmp_path / "model.ptd"
    assert data.stat().st_size > 0.9 * inside.stat().st_size > 10 * pte.stat().st_size
    want = LLMRunner(inside).generate(PROMPT, max_new_tokens=8, temperature=0.9, seed=7).token_ids
    assert LLMRunner(pte).generate(PROMPT, max_new_tokens=8, temperature=0.9, seed=7).token_ids == want
    assert cpp_ids(pte, PROMPT, 8, 0.9, 7) == want
    moved = data.rename(tmp_path / "elsewhere.ptd")
    assert LLMRunner(pte, data_path=moved).generate(PROMPT, max_new_tokens=8, temperature=0.9,
                                                    seed=7).token_ids == want
    assert cpp_ids(pte, PROMPT, 8, 0.9, 7, "--data", str(moved)) == want
    with pytest.raises(FileNotFoundError, match=f"keeps its weights in model.ptd; {data} does not exist"):
        LLMRunner(pte)
    done = cpp(pte, "--prompt-ids", "1")
    assert done.returncode == 1 and f"keeps its weights in model.ptd; {data} cannot be read" in done.stderr
    with pytest.raises(FileNotFoundError, match="keeps its weights in model.ptd: give its path"):
        LLMRunner(pte.read_bytes())
    with pytest.raises(ValueError, match="holds its weights: it takes no data file"):
        LLMRunner(inside, data_path=moved)
    done = cpp(inside, "--prompt-ids", "1", "--data", str(moved))
    assert done.returncode == 2 and "holds its weights: it takes no --data file" in done.stderr
    # A corrupt data file is refused before ExecuTorch reads its offsets (a
    # flipped byte in its FlatBuffer crashed both runners): truncated, the
    # root offset, a header size, a table's offset.
    good = moved.read_bytes()
    for case, bad in enumerate([good[:len(good) // 2], b"\xff" + good[1:], good[:20] + b"\x7f" + good[21:],
                                good[:72] + bytes([good[72] ^ 0x40]) + good[73:]]):
        corrupt = tmp_path / f"corrupt{case}.ptd"
        corrupt.write_bytes(bad)
        with pytest.raises(ValueError, match=f"corrupt data file {corrupt}"):
            LLMRunner(pte, data_path=corrupt)
        done = cpp(pte, "--prompt-ids", "1", "--data", str(corrupt))
        assert done.returncode == 1 and f"corrupt data file {corrupt}" in done.stderr, (case, done.stderr)
    assert main(["export", str(folder), "-o", str(tmp_path / "cli.ptd"), "--external-weights", "--quiet"]) == 2
    assert "cli.ptd would be its own weights file" in capsys.readouterr().err


@pytest.mark.parametrize("temperature,flags", [(0.0, []), (1.1, ["--top-p", "0.9", "--repetition-penalty", "1.3"])])
def test_cpp_runner_runs_a_batched_program_in_row_0(shared, temperature, flags):
    """A --max-batch program (llm/export/batched.py) gives its one-row program's ids."""
    from llm_programs import batched_chat_program

    _, batched, single = batched_chat_program(shared)
    kwargs = dict(top_p=0.9, repetition_penalty=1.3) if flags else {}
    want = LLMRunner(single).generate(PROMPT, max_new_tokens=8, temperature=temperature, seed=5, **kwargs)
    assert cpp_ids(batched, PROMPT, 8, temperature, 5, *flags) == want.token_ids
