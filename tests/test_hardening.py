"""Issue 16 (hardening II): the user surface around a loaded LLM program.
Threads, streamed text, NaN logits, runner arguments, careless paths and
incomplete weights each get an outcome asserted: the same tokens, or an
error naming the cause, with files left intact."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import pytest
import torch

import executorch_mlx
from executorch_mlx.llm.hf_export import export_llm
from executorch_mlx.llm.model_folders import write_model_folder
from executorch_mlx.llm.runner import LLMRunner

PROMPT = "Once upon a time"
MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A tiny Llama with an all-bytes tokenizer (sampled text splits UTF-8),
    exported sampling and logits-only."""
    root = tmp_path_factory.mktemp("hardening")
    folder = write_model_folder(root / "llama", "llama", layers=1, hidden=32, heads=2, kv_heads=1,
                                intermediate=64, all_bytes=True)
    sampled = export_llm(folder, root / "s.pte", max_context=MAX_CONTEXT, progress=None)
    logits = export_llm(folder, root / "l.pte", max_context=MAX_CONTEXT, sampling=False, progress=None)
    return folder, sampled, logits


def in_thread(fn):
    """fn() run in a new thread: its result, or its exception raised here."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# ------------------------------------------------------------------ threads --
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_load_in_main_thread_generate_in_worker(llm, temperature):
    """MLX streams are per thread: a program loaded here and first run in a
    worker used to fail ("There is no Stream(cpu, 0) in current thread",
    reported as a reset KV cache)."""
    folder, pte, _ = llm
    want = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3)
    runner = LLMRunner(pte, folder)  # loaded in this thread, never run here
    got = in_thread(lambda: runner.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3))
    assert got.token_ids == want.token_ids and got.text == want.text
    # and back in the loading thread
    assert runner.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3).token_ids == want.token_ids


def test_logits_program_loaded_in_main_runs_in_worker(llm):
    folder, _, pte = llm
    want = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=8)
    runner = LLMRunner(pte, folder)
    assert in_thread(lambda: runner.generate(PROMPT, max_new_tokens=8)).token_ids == want.token_ids


def _generations(runner, seeds):
    return [runner.generate(PROMPT, max_new_tokens=12, temperature=1.2, seed=s).token_ids for s in seeds]


def test_two_runners_in_two_threads_equal_serial(llm):
    folder, pte, _ = llm
    runners = [LLMRunner(pte, folder), LLMRunner(pte, folder)]
    seeds = [[1, 2, 3, 4], [5, 6, 7, 8]]
    serial = [_generations(LLMRunner(pte, folder), s) for s in seeds]
    results = [None, None]

    def work(i):
        results[i] = _generations(runners[i], seeds[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


def test_one_runner_shared_by_threads_serializes(llm):
    """One runner, one KV cache: concurrent generate calls take turns (a
    lock), each giving the tokens it gives alone."""
    folder, pte, _ = llm
    runner = LLMRunner(pte, folder)
    seeds = [[11, 12, 13], [14, 15, 16], [17, 18, 19]]
    serial = [_generations(runner, s) for s in seeds]
    results = [None] * len(seeds)

    def work(i):
        results[i] = _generations(runner, seeds[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


# ------------------------------------------------------------ streamed text --
def test_streamed_text_equals_the_result_over_100_seeds(llm):
    """Pieces of a multi-byte character wait until it is complete; whatever
    is left (an unfinished character's U+FFFD) is emitted at the end."""
    folder, pte, _ = llm
    runner = LLMRunner(pte, folder)
    broken = 0
    for seed in range(100):
        pieces = []
        result = runner.generate(PROMPT, max_new_tokens=40, temperature=1.5, seed=seed, on_text=pieces.append)
        assert "".join(pieces) == result.text, f"seed {seed}"
        broken += "\ufffd" in result.text
    assert broken > 10, "the all-bytes tokenizer should produce split UTF-8 in many seeds"


# ------------------------------------------------------- no valid token/NaN --
@pytest.fixture(scope="module")
def nan_logits_pte(llm, tmp_path_factory):
    """The llm folder with a NaN final norm (every logit NaN), logits-only."""
    from safetensors.torch import load_file, save_file

    folder, _, _ = llm
    root = tmp_path_factory.mktemp("nan")
    nan_folder = root / "nan"
    shutil.copytree(folder, nan_folder)
    weights = load_file(nan_folder / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, nan_folder / "model.safetensors", metadata={"format": "pt"})
    return nan_folder, export_llm(nan_folder, root / "nan.pte", max_context=16, sampling=False, progress=None)


def test_nan_logits_program_is_an_error_in_python(nan_logits_pte):
    folder, pte = nan_logits_pte
    with pytest.raises(RuntimeError, match=r"no valid token \(id -1\): its logits are all NaN or -inf"):
        LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=4)


def test_nan_logits_program_is_an_error_in_cpp(nan_logits_pte):
    _, pte = nan_logits_pte
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6", "--max-new-tokens", "4"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "no valid token (id -1): its logits are all NaN or -inf" in done.stderr


# ------------------------------------------------------------ runner inputs --
def test_cpp_runner_max_new_tokens_cannot_overflow(llm):
    _, pte, _ = llm
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6,7",
                           "--max-new-tokens", str(2**63 - 1)], capture_output=True, text=True)
    assert done.returncode == 2, done.stdout
    assert f"exceeds the max context of {MAX_CONTEXT}" in done.stderr and "ids:" not in done.stdout


@pytest.mark.parametrize("bias,match", [({-1: 5.0}, r"logit_bias: token id -1 is outside \[0, 384\)"),
                                        ({384: 5.0}, r"logit_bias: token id 384 is outside \[0, 384\)"),
                                        ({50: 1e40}, r"logit_bias\[50\] = 1e\+40 does not fit in float32")])
def test_python_runner_refuses_logit_bias_like_cpp(llm, bias, match):
    folder, pte, _ = llm
    with pytest.raises(ValueError, match=match):
        LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=2, logit_bias=bias)


@pytest.mark.parametrize("flag,message", [("-1=5", "token ids must be in [0, 384)"),
                                          ("50=1e40", "--logit-bias: 1e40 does not fit in float32")])
def test_cpp_runner_refuses_logit_bias(llm, flag, message):
    _, pte, _ = llm
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6",
                           f"--logit-bias={flag}"], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_tokenizer_smaller_than_the_model_is_an_error(llm, tmp_path):
    """An id the tokenizer lacks would vanish from the text: refused when
    generated (not at load: real models pad their vocabulary beyond the
    tokenizer's, e.g. Qwen2.5 and Phi-3)."""
    from executorch_mlx.llm.model_folders import train_tokenizer

    folder, pte, _ = llm
    small = tmp_path / "small"
    small.mkdir()
    train_tokenizer(vocab_size=300, all_bytes=True).save(str(small / "tokenizer.json"))
    runner = LLMRunner(pte, small)
    # a logit bias of +inf forces an id only the model has
    with pytest.raises(RuntimeError, match=r"generated token id 350, which its tokenizer does not have "
                                           r"\(300 tokens; the model has 384\)"):
        runner.generate(PROMPT, max_new_tokens=4, logit_bias={350: float("inf")})
