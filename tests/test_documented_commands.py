"""The README's commands, run as written, and the docs pages it links.

Every fenced shell or Python block of the README is marked `<!-- runnable:
NAME -->`, and NAME says what runs it: `scripts/dev` (the block names
scripts/dev's own jobs), `lower-a-model` (test_docs_and_tools.py), `serve*`
(test_serve.py, on a free port), or a test below, which runs the block
verbatim (shell lines in bash)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import executorch_mlx
from executorch_mlx.llm.model_folders import write_model_folder

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^(?:<!-- runnable: (\S+) -->\n)?```(bash|sh|shell|console|python)\n(.*?)^```", re.S | re.M)


def code_blocks(path: Path) -> list[tuple[str | None, str]]:
    """(marker name or None, text) of each fenced shell or Python block."""
    return [(name, body) for name, _, body in FENCE.findall(path.read_text())]


def runnable(path: Path, name: str) -> list[str]:
    """The lines of the block marked `name`, less blank and comment lines."""
    [body] = [body for marker, body in code_blocks(path) if marker == name]
    return [line for line in body.splitlines() if line.strip() and not line.startswith("#")]


def bash(lines: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=cwd, capture_output=True, text=True)


def test_every_readme_command_is_exercised():
    blocks = code_blocks(README)
    assert [name for name, _ in blocks if name is None] == [], "a README code block without a runnable marker"
    assert sorted(name for name, _ in blocks) == ["cpp-build", "export-generate", "lower-a-model",
                                                  "python-generate", "scripts/dev", "serve", "serve-curl",
                                                  "serve-openai"]  # each run by a test (serve*: test_serve.py)
    jobs = re.findall(r"^  (\w+)\)", (ROOT / "scripts" / "dev").read_text(), re.M)
    for line in runnable(README, "scripts/dev"):
        command = line.split("#")[0].split()
        assert command[0] == "scripts/dev" and command[1] in jobs, line


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_resolve_and_every_page_is_linked_from_the_readme():
    assert DOCS, "docs/ is empty"
    linked = set()
    for page in [README, *DOCS]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if page == README:
                linked.add(path)
            assert path.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}"
    assert set(DOCS) <= linked, f"docs pages the README does not link: {set(DOCS) - linked}"


def test_the_cpp_build_line_is_the_same_in_the_readme_and_its_page():
    assert runnable(README, "cpp-build") == runnable(ROOT / "docs" / "cpp-runner.md", "cpp-build")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder where the README's export -> generate block runs verbatim:
    `.venv` is this interpreter's environment and MODEL_DIR a tiny model."""
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / ".venv").symlink_to(sys.prefix)
    # one layer: what runs here is the README's commands (two-layer exports: tests/test_llm.py)
    write_model_folder(tmp / "MODEL_DIR", "llama", layers=1)
    done = bash(runnable(README, "export-generate"), tmp)
    return tmp, done


def test_readme_export_and_generate_print_only_our_lines(workspace):
    tmp, done = workspace
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "generate streamed no text"
    # stderr: export's stage lines and generate's speeds, nothing of torch,
    # transformers or torchao (and no bar: stderr is not a terminal)
    ours = re.compile(r"\[\s*\d+\.\d s\] .+|prefill [\d.]+ tokens/s, decode [\d.]+ tokens/s \(.+\)")
    assert [line for line in done.stderr.splitlines() if not ours.fullmatch(line)] == []
    assert "Warning" not in done.stderr and "\r" not in done.stderr
    # 7 linears of the one layer, the embedding table and the head tied to it
    assert "quantized 9 layers to int4 group 64" in done.stderr
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(tmp / "model.pte"))
    assert program.load_method("emlx_quantization").execute([])[0] == "int4 group 64 +embedding, bf16 scales"


def test_readme_python_generate_gives_the_text_of_the_command(workspace, monkeypatch, capsys):
    tmp, done = workspace
    assert done.returncode == 0, done.stderr
    monkeypatch.chdir(tmp)
    names: dict = {}
    exec(compile("\n".join(runnable(README, "python-generate")), "README.md", "exec"), names)
    assert done.stdout == names["result"].text + "\n"  # same prompt, temperature and seed as the command
    assert capsys.readouterr().out.startswith(names["result"].text)


def test_readme_cpp_build_line_builds_a_runner_that_runs(workspace):
    """Configures and builds into the repository's build/cpp, as a user would:
    the folder pip's build used, so it relinks for the build rpaths and
    compiles nothing; then runs the runner where the README's model.pte is:
    it prints the ids the pip-built runner prints."""
    tmp, exported = workspace
    assert exported.returncode == 0, exported.stderr
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the README's line uses the repository's .venv (scripts/dev makes it)")
    build, run = runnable(README, "cpp-build")
    # the line as written; CMake's own variable spreads the compiles over the cores
    built = subprocess.run(["bash", "-e", "-c", build], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)})
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (tmp / "build").symlink_to(ROOT / "build")
    ran = bash([run], tmp)
    assert ran.returncode == 0, ran.stderr
    ids = ran.stdout.splitlines()[0]
    assert ids.startswith("ids: ") and len(ids.split()) == 1 + 32, ran.stdout
    pip_built = subprocess.run([str(executorch_mlx.runner_binary()), *run.split()[1:]], cwd=tmp,
                               capture_output=True, text=True)
    assert pip_built.stdout.splitlines()[0] == ids
