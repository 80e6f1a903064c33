"""Hugging Face decoder-only LLMs end to end: a model folder (random weights,
a tokenizer trained on the fly) is exported to a .pte whose KV cache and
sampler live in one MLX delegate, then generates text through ExecuTorch's
runtime. Greedy ids must equal transformers' own greedy generation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_runs import cli
from llm_programs import SAMPLED, family_program
from transformers import AutoModelForCausalLM

from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import FAMILIES, write_model_folder
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = "Once upon a time"


def non_delegated_ops(pte: bytes, method: str = "forward") -> list[str]:
    """Kernels a method calls outside delegates (ExecuTorch's own view)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte)
    program = getattr(program, "program", program)
    (plan,) = [p for p in program.execution_plan if p.name == method]
    return [op.name for op in plan.operators]


def eager_greedy(folder, ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def exported(shared):
    """(family, sampling) -> (folder, .pte path), built once per run on first use."""
    return lambda family, sampling=True: family_program(shared, family, sampling)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(exported, family):
    folder, pte = exported(family, sampling=family in SAMPLED)
    assert non_delegated_ops(pte.read_bytes()) == [], "every op of a step runs in the MLX delegate"
    runner = LLMRunner(pte, folder)
    result = runner.generate(PROMPT, max_new_tokens=32)
    ids = runner.tokenizer.encode(PROMPT).ids
    assert result.token_ids == eager_greedy(folder, ids, 32)
    assert result.text == runner.tokenizer.decode(result.token_ids)
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0


def test_a_runner_starts_without_torch_and_generates_what_it_generates_beside_it(exported):
    """A process that runs a program (LLMRunner, and so generate, chat and
    serve) imports neither torch nor ExecuTorch's export stack: seconds of
    start-up it never uses (loaded_program.py). Its tokens are this
    process's, where torch is loaded."""
    folder, pte = exported("llama")
    code = f"""
import sys
from executorch_mlx.llm.run.runner import LLMRunner
runner = LLMRunner({str(pte)!r}, {str(folder)!r})
print(runner.generate({PROMPT!r}, max_new_tokens=8, temperature=0.8, seed=3).token_ids)
print(sorted(m for m in ("torch", "executorch.exir", "executorch.extension.pybindings.portable_lib")
             if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[1] == "[]"
    here = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=3)
    assert out[0] == str(here.token_ids)


def test_bfloat16_export_matches_transformers(exported, tmp_path):
    folder, _ = exported("llama")
    pte = export_llm(folder, tmp_path / "bf16.pte", ExportOptions(max_context=64, dtype="bf16"), progress=None)
    runner = LLMRunner(pte, folder)
    ids = runner.tokenizer.encode(PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert runner.generate(PROMPT, max_new_tokens=16).token_ids == want


@pytest.mark.parametrize("length", [1, 7, 64])
def test_prompts_prefill_in_one_call_then_decode(exported, length):
    folder, pte = exported("llama")
    runner = LLMRunner(pte, folder)
    calls = []
    execute = runner.method.execute
    runner.method = type("Counting", (), {"execute": lambda self, xs: calls.append(xs[0].shape[1]) or execute(xs)})()
    ids = [(7 * i + 3) % runner.vocab_size for i in range(length)]
    result = runner.generate(ids, max_new_tokens=12)
    assert calls[0] == length and set(calls[1:]) <= {1}, calls  # one prefill call, then one token per call
    assert result.token_ids == eager_greedy(folder, ids, 12)


def test_long_prompts_prefill_in_chunks(exported):
    folder, pte = exported("qwen2")
    runner = LLMRunner(pte, folder)
    runner.max_chunk = 5  # as if exported with a smaller maximum chunk
    ids = [(5 * i + 1) % runner.vocab_size for i in range(23)]
    assert runner.generate(ids, max_new_tokens=6).token_ids == eager_greedy(folder, ids, 6)


def test_the_cache_persists_between_calls_and_resets(exported):
    """Logits of a decode step equal eager's with the right cache; after a
    reset (an empty cache) the same step gives different logits."""
    from transformers.cache_utils import DynamicCache

    folder, pte = exported("llama", sampling=False)
    runner = LLMRunner(pte, folder)
    ids = [5, 9, 17, 33, 2, 7, 11]
    step = lambda tok, pos: torch.from_numpy(runner.method.execute([[[tok]], [pos]])[0])  # noqa: E731
    runner.method.execute([torch.tensor([ids]), torch.arange(len(ids))])
    got = step(4, len(ids))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        want = model(torch.tensor([[4]]), past_key_values=cache, use_cache=True).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    runner.reset()
    assert (step(4, len(ids)) - got).abs().max() > 1e-3


def test_a_new_conversation_needs_no_reset(exported):
    """Whatever an earlier, longer generation left in the cache is never read."""
    folder, pte = exported("qwen3")
    runner = LLMRunner(pte, folder)
    runner.generate(list(range(3, 60)), max_new_tokens=20)
    ids = [9, 4, 22]
    assert runner.generate(ids, max_new_tokens=10).token_ids == eager_greedy(folder, ids, 10)


def test_seeded_sampling_is_reproducible(exported):
    folder, pte = exported("llama")
    runner = LLMRunner(pte, folder)
    runs = [runner.generate(PROMPT, max_new_tokens=24, temperature=0.9, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0] != runner.generate(PROMPT, max_new_tokens=24).token_ids  # not greedy


def test_streamed_text_is_the_whole_text(exported):
    folder, pte = exported("llama")
    pieces = []
    result = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=16, on_text=pieces.append)
    assert "".join(pieces) == result.text.rstrip("\ufffd")


def test_no_sampling_export_runs_in_executorchs_text_runner(exported):
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    folder, pte = exported("llama", sampling=False)
    ours = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=8)
    pieces = []
    runner = TextLLMRunner(str(pte), str(folder / "tokenizer.json"))
    runner.generate(PROMPT, GenerationConfig(max_new_tokens=8, temperature=0.0, echo=False),
                    token_callback=pieces.append)
    assert "".join(pieces) == ours.text


# ---------------------------------------------------------------- errors --
@pytest.mark.parametrize("edit,error,match", [
    ({"model_type": "t5"}, ValueError, r"model_type 't5' is not a causal language model transformers knows"),
    ({"layer_types": ["compressed_sparse_attention", "full_attention"]}, NotImplementedError,
     "has compressed_sparse_attention layers, which export does not build yet"),
])
def test_what_export_does_not_build_yet_is_named(exported, tmp_path, edit, error, match):
    """No list of families: any causal LM goes through, and what export
    cannot build yet is refused from config.json, before the weights load."""
    folder, _ = exported("llama")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(error, match=match):
        export_llm(bad, tmp_path / "x.pte", progress=None)


def test_an_op_without_lowering_is_an_error_naming_it_and_its_module(tmp_path, monkeypatch):
    """No silent portable fallback inside an LLM export: the op, its module
    and the reason, and nothing written (no spilled weights either)."""
    from executorch_mlx import partitioner

    # one layer: the export is refused once the partitioner has seen the graph (~5 s less than two)
    folder = write_model_folder(tmp_path / "llama", "llama", layers=1, hidden=32, heads=2, kv_heads=1,
                                intermediate=64)
    real = partitioner.why_not_lowered
    embedding = torch.ops.aten.embedding.default
    monkeypatch.setattr(partitioner, "why_not_lowered",
                        lambda n: "refused by this test" if partitioner.aten_op(n.target) == embedding else real(n))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NotImplementedError,
                       match=r"cannot lower every op .*: aten.embedding.default in model.embed_tokens "
                             r"\(refused by this test\)$"):
        export_llm(folder, out / "x.pte", ExportOptions(max_context=16, sampling=False), progress=None)
    assert list(out.iterdir()) == []


def test_missing_weights_config_or_tokenizer(exported, tmp_path):
    folder, pte = exported("llama")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(folder, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="no weights"):
        export_llm(no_weights, tmp_path / "x.pte", progress=None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_llm(tmp_path, tmp_path / "x.pte", progress=None)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLMRunner(pte, tmp_path)


def test_context_overflow_is_refused(exported):
    folder, pte = exported("llama")
    runner = LLMRunner(pte, folder)
    with pytest.raises(ValueError, match="max context is 128"):
        runner.generate(list(range(1, 129)), max_new_tokens=1)
    with pytest.raises(ValueError, match="exceeds the max context of 128"):
        runner.generate(list(range(1, 100)), max_new_tokens=40)
    with pytest.raises(ValueError, match="empty"):
        runner.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.generate(PROMPT, max_new_tokens=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # exported with and without logprobs
def test_cli_generate_json(exported, family, capfd):
    folder, pte = exported(family)
    res = cli(capfd, "generate", pte, "--tokenizer", folder, "--prompt", PROMPT, "--max-new-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # exactly one JSON object on stdout
    assert set(out) == {"token_ids", "text", "logprobs", "stop_reason", "prefill_tokens_per_s", "decode_tokens_per_s",
                        "draft_tokens", "accepted_tokens"}
    assert out["draft_tokens"] == out["accepted_tokens"] == 0  # no drafter given
    want = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=8)
    assert out["token_ids"] == want.token_ids and out["stop_reason"] == want.stop_reason
    if want.logprobs is None:
        assert out["logprobs"] is None
    else:
        assert out["logprobs"] == pytest.approx(want.logprobs) and len(want.logprobs) == 8
    bad = cli(capfd, "generate", pte, "--tokenizer", folder, "--prompt", PROMPT, "--max-new-tokens", "500")
    assert bad.returncode == 2 and "max context" in bad.stderr and "Traceback" not in bad.stderr


def test_sampler_parameters_reach_the_device(exported):
    """Each generate keyword changes the tokens the way docs/sampling.md says."""
    folder, pte = exported("llama")
    runner = LLMRunner(pte, folder)
    greedy = runner.generate(PROMPT, max_new_tokens=12).token_ids
    # +inf bias: that token always wins; -inf: never chosen
    assert set(runner.generate(PROMPT, max_new_tokens=5, logit_bias={42: float("inf")}).token_ids) == {42}
    banned = runner.generate(PROMPT, max_new_tokens=12, logit_bias={t: float("-inf") for t in set(greedy[:8])})
    assert not set(banned.token_ids) & set(greedy[:8])
    # a huge presence penalty over the whole window: no token repeats one of the last 64
    ids = runner.tokenizer.encode(PROMPT).ids
    out = runner.generate(PROMPT, max_new_tokens=40, presence_penalty=1e4, repetition_context_size=64).token_ids
    context = ids + out
    for i in range(len(ids), len(context)):
        assert context[i] not in context[max(0, i - 64):i]
    # top_k=1 is greedy at any temperature
    assert runner.generate(PROMPT, max_new_tokens=12, temperature=5.0, seed=1, top_k=1).token_ids == greedy


@pytest.mark.parametrize("kwargs,name", [
    (dict(top_p=1.5), "top_p"), (dict(min_p=1.0), "min_p"), (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(repetition_penalty=1.2, repetition_context_size=65), "repetition_context_size"),
    (dict(logit_bias={i: 1.0 for i in range(17)}), "logit_bias"),
])
def test_bad_sampler_parameters_are_refused_before_running(exported, kwargs, name):
    folder, pte = exported("llama")
    with pytest.raises(ValueError, match=name):
        LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=4, temperature=1.0, **kwargs)


def test_logprobs_export(exported):
    folder, pte = exported("llama")  # exported with logprobs
    result = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=6, temperature=0.8, seed=2)
    assert len(result.logprobs) == len(result.token_ids)
    assert all(-30 < lp <= 0 for lp in result.logprobs)
    # greedy picks the most likely token: its logprob is the largest, and >= log(1/V)
    greedy = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=6)
    vocab = LLMRunner(pte, folder).vocab_size
    assert all(lp >= -torch.log(torch.tensor(float(vocab))) for lp in greedy.logprobs)


def test_weights_wait_in_files_during_export(exported, tmp_path, monkeypatch):
    """Export loads each weight into a file beside the output as it reads it,
    quantizes from and into such files, and the named data store takes the
    files themselves (lowering/weight_files.py): with every tensor counted as
    large, every weight goes that way and none is written twice, the .pte is
    the same file byte for byte, and no file is left behind."""
    from executorch_mlx.llm.export.export_checks import load_weights
    from executorch_mlx.lowering import weight_files

    files = []

    def spy(path, **kw):
        files.append((path, kw.get("cleanup", False), os.path.getsize(path)))
        return spy.__wrapped__(path, **kw)

    # (a one-layer folder: the path of every weight shows in one layer)
    folder = write_model_folder(tmp_path / "in_memory" / "llama", "llama", layers=1)
    pte = export_llm(folder, tmp_path / "in_memory" / "a.pte",
                     ExportOptions(max_context=64, sampling=False, quantize="int4"), progress=None)
    spy.__wrapped__ = weight_files.FileBackedData
    monkeypatch.setattr(weight_files, "SPILL_BYTES", 1)
    monkeypatch.setattr(weight_files, "FileBackedData", spy)
    with weight_files.weight_files(tmp_path) as kept:
        model = load_weights(folder, torch.float32)
        assert all(kept.stored(p) is not None for p in model.parameters())
    del model
    assert [p.name for p in tmp_path.iterdir()] == ["in_memory"]  # (the folder is inside it)
    out = export_llm(folder, tmp_path / "spilled.pte", ExportOptions(max_context=64, sampling=False, quantize="int4"),
                     progress=None)
    assert files and all(p.startswith(str(tmp_path)) for p, _, _ in files)
    # the weights reach the store as the files they waited in; only tensors
    # made while lowering (a few floats) are written anew. ExecuTorch's
    # to_backend deep-copies the program: a copied weight would be read whole
    # into memory and written again (lowering/weight_files.py)
    assert sum(1 for _, spilled, _ in files if not spilled) >= 10
    assert all(size < 1024 for _, spilled, size in files if spilled)
    assert out.read_bytes() == pte.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in_memory", "spilled.pte"]


def test_the_readme_lists_the_tested_families():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    listed = readme.split("Tested families (each exported and held to transformers' greedy output):\n", 1)[1]
    assert listed.split(".\n", 1)[0].replace("\n", " ").split(", ") == list(FAMILIES)


@pytest.mark.parametrize("options,message", [
    (dict(dtype="fp64"), "dtype must be one of fp32, fp16, bf16"),
    (dict(max_context=1), r"max_context must be in \[2, 2\*\*20\]"),
    (dict(max_context=64.0), "max_context must be in"),
    (dict(quantize="int7"), "quantize must be one of"),
    (dict(quantize_embedding=True), "quantize_embedding needs quantize"),
    (dict(activations="int16"), "activations"),
    (dict(history_size=0), "history_size and logit_bias_size must be in"),
    (dict(top_logprobs=21), r"top_logprobs must be in \[0, 20\]"),
    (dict(top_logprobs=True), "top_logprobs must be in"),
    (dict(top_logprobs=2, sampling=False), "top_logprobs needs a sampling program"),
    (dict(max_batch=65), r"max_batch must be in \[1, 64\]"),
    (dict(max_draft_tokens=3, max_context=4), r"max_draft_tokens must be in \[0, 2\]"),
])
def test_export_options_are_checked_when_made(options, message):
    """A bad option is refused where it is given, before any folder is read."""
    from executorch_mlx.llm import ExportOptions

    with pytest.raises(ValueError, match=message):
        ExportOptions(**options)


def test_export_options_resolve_their_defaults():
    from executorch_mlx.llm import ExportOptions

    assert ExportOptions().drafts == 8 and ExportOptions(max_context=5).drafts == 3
    assert ExportOptions(max_batch=4).drafts == 0 and ExportOptions(sampling=False, max_draft_tokens=4).drafts == 0
    assert ExportOptions(top_logprobs=3).with_logprobs and not ExportOptions(logprobs=True, sampling=False).with_logprobs
