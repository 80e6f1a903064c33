"""Issue 16 (hardening II): the user surface around a loaded LLM program.
Threads, streamed text, NaN logits, runner arguments, careless paths and
incomplete weights each get an outcome asserted: the same tokens, or an
error naming the cause, with files left intact."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from cli_runs import cli
from container_fuzz import MAX_CONTEXT, export_program
from llm_programs import family_program

import executorch_mlx
from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.run.runner import LLMRunner

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(shared):
    """A tiny Llama with an all-bytes tokenizer (sampled text splits UTF-8),
    exported sampling (the program tests/test_container_fuzz.py uses too).
    The shared folder is read, never written."""
    sampled, folder = shared.get("tiny-llama", export_program)
    return folder, sampled


@pytest.fixture(scope="module")
def logits_llm(shared):
    """(folder, logits-only .pte): the Llama family program tests/test_llm.py uses."""
    return family_program(shared, "llama", sampling=False)


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
    folder, pte = llm
    want = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3)
    runner = LLMRunner(pte, folder)  # loaded in this thread, never run here
    got = in_thread(lambda: runner.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3))
    assert got.token_ids == want.token_ids and got.text == want.text
    # and back in the loading thread
    assert runner.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3).token_ids == want.token_ids


def test_logits_program_loaded_in_main_runs_in_worker(logits_llm):
    folder, pte = logits_llm
    want = LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=8)
    runner = LLMRunner(pte, folder)
    assert in_thread(lambda: runner.generate(PROMPT, max_new_tokens=8)).token_ids == want.token_ids


def _generations(runner, seeds):
    return [runner.generate(PROMPT, max_new_tokens=12, temperature=1.2, seed=s).token_ids for s in seeds]


def test_two_runners_in_two_threads_equal_serial(llm):
    folder, pte = llm
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
    folder, pte = llm
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
    folder, pte = llm
    runner = LLMRunner(pte, folder)
    broken = 0
    for seed in range(100):
        pieces = []
        result = runner.generate(PROMPT, max_new_tokens=40, temperature=1.5, seed=seed, on_text=pieces.append)
        assert "".join(pieces) == result.text, f"seed {seed}"
        broken += "\ufffd" in result.text
    assert broken > 10, "the all-bytes tokenizer should produce split UTF-8 in many seeds"


def test_streaming_a_long_answer_decodes_each_token_a_few_times(llm):
    """TextOut decodes a window (the last piece's tokens and the new ones),
    not the whole answer at each step: 3000 random ids (split UTF-8
    included) stream to the whole text while the tokenizer sees about 5
    ids per id (measured 4.9: random bytes split many characters), not
    3000 * 3000 / 2 in all."""
    from tokenizers import Tokenizer

    from executorch_mlx.llm.run.decode_parts import TextOut

    folder, _ = llm
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    class Counting:
        seen = 0

        def decode(self, ids):
            Counting.seen += len(ids)
            return tokenizer.decode(ids)

    ids = torch.randint(0, tokenizer.get_vocab_size(), (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    pieces = []
    out = TextOut(Counting(), [], pieces.append)
    for n in range(1, len(ids) + 1):
        out.update(ids[:n])
    out.update(ids, final=True)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert Counting.seen < 10 * len(ids)


# ------------------------------------------------------- no valid token/NaN --
@pytest.fixture(scope="module")
def nan_logits_pte(llm, tmp_path_factory):
    """The llm folder with a NaN final norm (every logit NaN), logits-only."""
    from safetensors.torch import load_file, save_file

    folder, _ = llm
    root = tmp_path_factory.mktemp("nan")
    nan_folder = root / "nan"
    shutil.copytree(folder, nan_folder)
    weights = load_file(nan_folder / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, nan_folder / "model.safetensors", metadata={"format": "pt"})
    return nan_folder, export_llm(nan_folder, root / "nan.pte", ExportOptions(max_context=16, sampling=False),
                                  progress=None)


def test_nan_logits_program_is_an_error_in_python(nan_logits_pte):
    folder, pte = nan_logits_pte
    with pytest.raises(RuntimeError, match=r"no valid token \(id -1\): its logits are all NaN or -inf"):
        LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=4)


def test_nan_logits_program_is_an_error_in_cpp(nan_logits_pte):
    _, pte = nan_logits_pte
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6",
                           "--max-new-tokens", "4"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "no valid token (id -1): its logits are all NaN or -inf" in done.stderr


# ------------------------------------------------------------ runner inputs --
def test_cpp_runner_max_new_tokens_cannot_overflow(llm):
    _, pte = llm
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6,7",
                           "--max-new-tokens", str(2**63 - 1)], capture_output=True, text=True)
    assert done.returncode == 2, done.stdout
    assert f"exceeds the max context of {MAX_CONTEXT}" in done.stderr and "ids:" not in done.stdout


@pytest.mark.parametrize("bias,match", [({-1: 5.0}, r"logit_bias: token id -1 is outside \[0, 384\)"),
                                        ({384: 5.0}, r"logit_bias: token id 384 is outside \[0, 384\)"),
                                        ({50: 1e40}, r"logit_bias\[50\] = 1e\+40 does not fit in float32")])
def test_python_runner_refuses_logit_bias_like_cpp(llm, bias, match):
    folder, pte = llm
    with pytest.raises(ValueError, match=match):
        LLMRunner(pte, folder).generate(PROMPT, max_new_tokens=2, logit_bias=bias)


@pytest.mark.parametrize("flag,message", [("-1=5", "token ids must be in [0, 384)"),
                                          ("50=1e40", "--logit-bias: 1e40 does not fit in float32")])
def test_cpp_runner_refuses_logit_bias(llm, flag, message):
    _, pte = llm
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(pte), "--prompt-ids", "5,6",
                           f"--logit-bias={flag}"], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_tokenizer_smaller_than_the_model_is_an_error(llm, tmp_path):
    """An id the tokenizer lacks would vanish from the text: refused when
    generated (not at load: real models pad their vocabulary beyond the
    tokenizer's, e.g. Qwen2.5 and Phi-3)."""
    from executorch_mlx.llm.model_folders import train_tokenizer

    folder, pte = llm
    small = tmp_path / "small"
    small.mkdir()
    train_tokenizer(vocab_size=300, all_bytes=True).save(str(small / "tokenizer.json"))
    runner = LLMRunner(pte, small)
    # a logit bias of +inf forces an id only the model has
    with pytest.raises(RuntimeError, match=r"generated token id 350, which its tokenizer does not have "
                                           r"\(300 tokens; the model has 384\)"):
        runner.generate(PROMPT, max_new_tokens=4, logit_bias={350: float("inf")})


# ------------------------------------------------------------------- export --
def _one_line_error(done: subprocess.CompletedProcess, command: str, fragment: str) -> None:
    """Exit code 2, no traceback, and the last line of stderr names the cause."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"executorch-mlx {command}: error: ") and fragment in last, done.stderr


def test_export_onto_the_models_own_weights_is_refused(llm, tmp_path, capfd):
    """The CLI's error is the one line on stderr and nothing is printed on
    stdout. (In a new process, where warnings of the imports would show:
    a CLI error in tests/test_container_fuzz.py, the README's export and
    generate in tests/test_documented_commands.py, which imports more.)"""
    folder = shutil.copytree(llm[0], tmp_path / "model")
    weights = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"is model.safetensors of the model folder .* would overwrite its input"):
        export_llm(folder, folder / "model.safetensors", ExportOptions(max_context=16), progress=None)
    for name in ("config.json", "tokenizer.json"):
        with pytest.raises(ValueError, match=rf"is {name} of the model folder"):
            export_llm(folder, folder / name, ExportOptions(max_context=16), progress=None)
    done = cli(capfd, "export", folder, "-o", folder / "model.safetensors")
    _one_line_error(done, "export", "would overwrite its input")
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and done.stderr.endswith("\n"), done.stderr
    assert (folder / "model.safetensors").read_bytes() == weights


def test_export_to_a_folder_or_a_missing_folder_is_refused(llm, tmp_path, capfd):
    folder = llm[0]
    with pytest.raises(IsADirectoryError, match=r"output .* is a folder"):
        export_llm(folder, tmp_path, ExportOptions(max_context=16), progress=None)
    with pytest.raises(FileNotFoundError, match=r"the output's folder .*nowhere does not exist"):
        export_llm(folder, tmp_path / "nowhere" / "m.pte", ExportOptions(max_context=16), progress=None)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"the output's folder .*file does not exist \(or is not a folder\)"):
        export_llm(folder, tmp_path / "file" / "m.pte", ExportOptions(max_context=16), progress=None)
    _one_line_error(cli(capfd, "export", folder, "-o", tmp_path), "export", "is a folder")


def test_export_to_an_unwritable_folder_is_refused_before_any_work(llm, tmp_path, monkeypatch):
    from executorch_mlx.llm.export import export_checks

    loaded = []
    monkeypatch.setattr(export_checks, "load_weights", lambda *a: loaded.append(a))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if (locked / "probe").touch() is None:  # root writes anyway: a read-only mount instead
            (locked / "probe").unlink()
            locked = Path("/sys")
            if not locked.is_dir() or os.access(locked, os.W_OK) and _writable(locked):
                pytest.skip("no unwritable folder here (root, and /sys is writable)")
    except PermissionError:
        pass
    with pytest.raises(PermissionError, match=rf"cannot write in the output's folder {locked}"):
        export_llm(llm[0], locked / "m.pte", ExportOptions(max_context=16), progress=None)
    assert not loaded, "refused before loading the model"


def _writable(folder: Path) -> bool:
    try:
        (folder / ".emlx_probe").touch()
    except OSError:
        return False
    (folder / ".emlx_probe").unlink()
    return True


def test_failed_export_leaves_the_old_file_and_reexport_under_a_loaded_program(llm, tmp_path, monkeypatch):
    """Out of space mid-write: the old .pte byte-identical, no partial file.
    A successful re-export replaces the file under a runner that has it
    loaded, which keeps working (it used to be truncated in place: SIGSEGV)."""
    from executorch_mlx.llm.export import export_checks

    folder, pte = llm
    target = tmp_path / "model.pte"
    shutil.copy(pte, target)
    old = target.read_bytes()
    runner = LLMRunner(target, folder)
    want = runner.generate(PROMPT, max_new_tokens=8).token_ids

    real_write = os.write

    def disk_full(fd, data):
        real_write(fd, bytes(data[:4096]))  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_checks, "_write", disk_full)
    with pytest.raises(OSError, match=r"writing .*model.pte failed \(No space left on device\); the file is unchanged"):
        export_llm(folder, target, ExportOptions(max_context=MAX_CONTEXT, logit_bias_size=4), progress=None)
    assert target.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pte"], "no partial or temporary file"
    monkeypatch.undo()

    target.chmod(0o640)
    export_llm(folder, target, ExportOptions(max_context=MAX_CONTEXT, logit_bias_size=4), progress=None)
    assert target.read_bytes() != old and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pte"]
    assert runner.generate(PROMPT, max_new_tokens=8).token_ids == want, "the loaded program still runs"
    assert LLMRunner(target, folder).generate(PROMPT, max_new_tokens=8).token_ids == want


# ------------------------------------------------------------------ weights --
@pytest.fixture
def folder_copy(llm, tmp_path):
    return shutil.copytree(llm[0], tmp_path / "model")


def _edit_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_tensor_is_refused_naming_it(folder_copy, tmp_path):
    _edit_weights(folder_copy, lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.0\.mlp\.up_proj\.weight"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)
    assert not (tmp_path / "m.pte").exists()


def test_an_unexpected_tensor_is_refused_naming_it(folder_copy, tmp_path):
    _edit_weights(folder_copy, lambda w: w.update({"model.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\): model\.extra\.weight"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)


def test_a_mis_shaped_tensor_is_refused_naming_it(folder_copy, tmp_path):
    _edit_weights(folder_copy, lambda w: w.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError,
                       match=r"mismatched tensor\(s\): model\.norm\.weight \[7\] \(the model's is \[32\]\)"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)


def test_weights_load_from_safetensors_only(folder_copy, tmp_path, monkeypatch):
    """pytorch_model.bin (pickle) beside a safetensors file of another name
    is never loaded."""
    from safetensors.torch import load_file

    torch.save(load_file(folder_copy / "model.safetensors"), folder_copy / "pytorch_model.bin")
    (folder_copy / "model.safetensors").rename(folder_copy / "adapter.safetensors")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(ValueError, match=r"cannot load the weights of .*model"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)
    assert not loads, "torch.load was called"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "truncated shard"])
def test_corrupt_safetensors_is_an_error(folder_copy, tmp_path, damage, capfd):
    """Found from the header, before the model is built (the CLI refuses in
    seconds), in model.safetensors or in a shard that the index names."""
    path = folder_copy / "model.safetensors"
    if damage == "truncated shard":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            names = list(f.keys())
        path = path.rename(folder_copy / "model-00001-of-00001.safetensors")
        (folder_copy / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {name: path.name for name in names}}))
    data = path.read_bytes()
    path.write_bytes(b"\x07" * 100 if damage == "garbage" else data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot load the weights of .*: corrupt safetensors \(Error while "
                                         r"deserializing header"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)
    if damage != "truncated shard":
        _one_line_error(cli(capfd, "export", folder_copy, "-o", tmp_path / "m.pte"), "export",
                        "cannot load the weights of")


# ------------------------------------------------------------------- config --
def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,match", [
    (dict(num_attention_heads=3, num_key_value_heads=3, head_dim=None),
     r"hidden_size 32 is not divisible by num_attention_heads 3"),
    # with head_dim given, transformers' own validation of the config
    (dict(num_attention_heads=3, num_key_value_heads=3),
     r"config\.json is inconsistent: .*hidden size \(32\) is not a multiple of the number of attention heads \(3\)"),
    (dict(num_key_value_heads=3), r"num_attention_heads 2 is not divisible by num_key_value_heads 3"),
    (dict(pad_token_id=384), r"pad_token_id 384 is not a token id in \[0, 384\)"),
    (dict(vocab_size=0), r"vocab_size must be a positive integer, got 0"),
])
def test_inconsistent_config_is_an_error_naming_the_field(folder_copy, tmp_path, changes, match):
    _edit_config(folder_copy, **changes)
    with pytest.raises(ValueError, match=match):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)


def test_config_that_is_not_json_names_the_file(folder_copy, tmp_path):
    (folder_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=16), progress=None)


def test_context_beyond_the_trained_positions_needs_allowing(folder_copy, tmp_path, capfd):
    from executorch_mlx.llm.export.export_checks import check_context
    from executorch_mlx.llm.export.hf_export import read_config

    _edit_config(folder_copy, max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"max_context 64 exceeds the model's max_position_embeddings 32 .*"
                                         r"allow_longer_context=True \(--allow-longer-context\)"):
        export_llm(folder_copy, tmp_path / "m.pte", ExportOptions(max_context=64), progress=None)
    _one_line_error(cli(capfd, "export", folder_copy, "-o", tmp_path / "m.pte", "--max-context", "64"),
                    "export", "exceeds the model's max_position_embeddings 32")
    check_context(read_config(folder_copy), folder_copy, 64, True, 4)  # allowed: no error


def test_control_flow_on_a_run_time_value_is_a_named_refusal():
    from executorch_mlx.llm.export.hf_export import trace

    class Branches(torch.nn.Module):
        def forward(self, x):
            return x + 1 if x.sum() > 0 else x - 1

    with pytest.raises(NotImplementedError, match=r"^folder: the model's code depends on a value it computes at "
                                                  r"run time, which export cannot trace into a static graph"):
        trace(Branches(), (torch.ones(3),), None, "folder")


def test_kv_cache_over_the_memory_budget_is_refused_at_export(llm, tmp_path):
    # 1 layer, 1 KV head of 16, keys and values, float32: 128 bytes a position
    executorch_mlx.set_memory_budget(64 << 10)
    try:
        with pytest.raises(ValueError, match=r"KV cache at max_context 1024 takes 128\.0 KiB \(131072 bytes\), "
                                             r"over this machine's memory budget of 64\.0 KiB \(65536 bytes\)"):
            export_llm(llm[0], tmp_path / "m.pte", ExportOptions(max_context=1024), progress=None)
    finally:
        executorch_mlx.set_memory_budget(None)


# ------------------------------------------------------- files given to run --
@pytest.fixture(scope="module")
def bad_files(llm, tmp_path_factory):
    """Files a careless user or an attacker hands the runners."""
    from executorch_mlx.llm.export.sampling import export_greedy_head

    _, pte = llm
    root = tmp_path_factory.mktemp("bad")
    data = pte.read_bytes()
    files = {"zero": b"", "random": bytes(torch.randint(0, 256, (300,), dtype=torch.uint8).tolist()),
             "identifier": b"\x10\0\0\0\xff\xfe\xfd\xfc" + bytes(200),
             "byte58": data[:58] + bytes([data[58] ^ 0xFF]) + data[59:],
             "truncated": data[:len(data) // 3]}

    class Logits(torch.nn.Module):
        def forward(self, x):
            return x.float().unsqueeze(-1).repeat(1, 1, 8)

    files["sampling-head"] = export_greedy_head(Logits(), (torch.ones(1, 3, dtype=torch.int64),)).buffer
    paths = {}
    for name, content in files.items():
        paths[name] = root / f"{name}.pte"
        paths[name].write_bytes(content)
    return paths


GENERATE_ERRORS = {
    "zero": "is not an ExecuTorch program",
    "random": "is not an ExecuTorch program",
    "identifier": "is not an ExecuTorch program",
    "byte58": "cannot load",
    "truncated": "cannot load",
    "sampling-head": "this .pte's 'get_max_context_len' metadata is missing",
}


@pytest.mark.parametrize("name", sorted(GENERATE_ERRORS))
def test_generate_refuses_bad_files_with_one_line(llm, bad_files, name, capfd):
    folder = llm[0]
    _one_line_error(cli(capfd, "generate", bad_files[name], "--tokenizer", folder, "--prompt", "hi"),
                    "generate", GENERATE_ERRORS[name])


@pytest.mark.parametrize("name", ["zero", "random", "identifier", "byte58", "truncated"])
def test_cpp_runner_refuses_bad_files_without_a_signal(bad_files, name):
    done = subprocess.run([str(executorch_mlx.runner_binary()), str(bad_files[name]), "--prompt-ids", "5,6",
                           "--max-new-tokens", "2"], capture_output=True, text=True, errors="replace", timeout=60)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "emlx_runner: error: " in done.stderr
    if name in ("zero", "random", "identifier"):
        assert "is not an ExecuTorch program" in done.stderr


@pytest.mark.parametrize("name,fragment", [("zero", "is not an ExecuTorch program"),
                                           ("random", "is not an ExecuTorch program"),
                                           ("identifier", "is not an ExecuTorch program"),
                                           ("byte58", "is not a readable .pte (corrupt or truncated)")])
def test_inspect_refuses_bad_files_with_one_line(bad_files, name, fragment, capfd):
    _one_line_error(cli(capfd, "inspect", bad_files[name]), "inspect", fragment)


def test_a_tokenizer_that_is_not_json_is_an_error(llm, tmp_path):
    _, pte = llm
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
        LLMRunner(pte, tmp_path)


def test_cli_shows_the_runtimes_reason_for_a_load_failure(llm, capfd, monkeypatch):
    """A memory-budget refusal used to end with ExecuTorch's "error 0x:23".
    The runtime reads EMLX_MEMORY_BUDGET at each load (memory_budget.cpp)."""
    folder, pte = llm
    monkeypatch.setenv("EMLX_MEMORY_BUDGET", "10000")
    _one_line_error(cli(capfd, "generate", pte, "--tokenizer", folder, "--prompt", "hi"), "generate",
                    "over the memory budget of 10000 bytes")
