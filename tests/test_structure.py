"""The shape of the code, checked: one table of sampler parameters, one
program contract, no import cycle between the package's subpackages, no
library module that rebinds another's globals, nothing pointing outside the
repository."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import torch
from cli_runs import cli

from executorch_mlx.llm import program_contract
from executorch_mlx.serialization import sampler_params

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backends" / "mlx"
GENERATED = "@generated"


def _library_sources() -> list[Path]:
    """Hand-written library and runtime sources (not generated files)."""
    files = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h", ".fbs", ".inc")]
    return [p for p in files if GENERATED not in p.read_text(errors="replace")[:300]]


def test_each_row_parameter_is_named_in_at_most_four_hand_written_files():
    """Its table row (schema.fbs), its math in the reference and the kernel:
    everything else reads the generated table."""
    sources = {p: p.read_text(errors="replace") for p in _library_sources()}
    for name in sampler_params.ROW_PARAMS:
        naming = sorted(str(p.relative_to(PACKAGE)) for p, text in sources.items() if name in text)
        assert "serialization/schema.fbs" in naming
        assert len(naming) <= 4, (name, naming)


def test_the_op_schema_follows_the_table():
    args = [a.name for a in torch.ops.mlx.sample.default._schema.arguments]
    assert args == ["logits", "temperature", "seed", "position", *sampler_params.PARAMS]
    controls = [p.name for p in sampler_params.SAMPLER_INPUTS if p.kind == "control"]
    assert controls == ["temperature", "seed", "position"]


def test_every_off_value_is_valid_and_turns_its_parameter_off():
    from executorch_mlx.llm.sampler_inputs import sampling_inputs

    logits = torch.randn(3, 16)
    history = torch.randint(0, 16, (3, 4))
    base = torch.ops.mlx.sample(logits, torch.tensor(0.7), torch.tensor(5), torch.tensor(2))
    for name in sampler_params.ROW_PARAMS:
        spec = sampler_params.BY_NAME[name]
        off = torch.tensor(spec.off, dtype=torch.int64 if spec.integer else torch.float32)
        sampling_inputs(3, 0.7, **{name: spec.off})  # the off value passes the host checks
        extra = {"history": history} if spec.needs == "history" else {}
        got = torch.ops.mlx.sample(logits, torch.tensor(0.7), torch.tensor(5), torch.tensor(2), **{name: off}, **extra)
        assert torch.equal(got, base), name


def test_host_checks_say_the_tables_range():
    import pytest

    from executorch_mlx.llm.sampler_inputs import sampling_inputs

    for spec in sampler_params.SAMPLER_INPUTS:
        if spec.valid is None or spec.kind == "control":
            continue
        lo, lo_closed, hi, hi_closed = spec.valid
        bad = lo if not lo_closed else lo - 1  # just outside the low end
        if spec.integer and bad == float("-inf"):
            continue
        with pytest.raises(ValueError, match=re.escape(f"{spec.name} must be {spec.expect}")):
            sampling_inputs(2, 1.0, **{spec.name: int(bad) if spec.integer else bad})


def test_generate_has_a_flag_per_table_row_with_one(capfd):
    done = cli(capfd, "generate", "--help")
    assert done.returncode == 0, done.stderr
    for spec in sampler_params.SAMPLER_INPUTS:
        if spec.cli:
            assert spec.cli in done.stdout, spec.name


def test_the_cpp_runner_reads_the_contracts_names():
    header = (PACKAGE / "runtime" / "generated" / "program_contract.h").read_text()
    for value in program_contract.CPP_CONSTANTS.values():
        assert f'"{value}"' in header
    runner = (PACKAGE / "runtime" / "llm_runner.cpp").read_text()
    for value in program_contract.CPP_CONSTANTS.values():
        assert f'"{value}"' not in runner, value  # spelled once, in the generated header


# ------------------------------------------------------------- imports --
def _imports(path: Path) -> set[str]:
    """The modules `path` imports (relative imports resolved), top level or not."""
    package = path.relative_to(PACKAGE).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            target = ".".join(("executorch_mlx", *base, *(node.module.split(".") if node.module else ())))
            if not node.level:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _unit(parts: tuple[str, ...]) -> str | None:
    """The subpackage or top-level module of a module path inside the package."""
    if not parts or parts[0] in ("__init__", "__init__.py"):
        return None  # the package root imports everything; nothing imports it for its contents
    return parts[0].removesuffix(".py")


def test_no_import_cycle_between_subpackages():
    """Edges between subpackages and top-level modules of executorch_mlx, from
    every import (also those inside functions); the graph must be acyclic."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        here = _unit(path.relative_to(PACKAGE).parts)
        for module in _imports(path):
            parts = module.split(".")
            there = _unit(tuple(parts[1:])) if parts[0] == "executorch_mlx" else None
            exists = there and ((PACKAGE / there).is_dir() or (PACKAGE / f"{there}.py").is_file())
            if here and exists and there != here:
                edges.setdefault(here, set()).add(there)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    assert {"lowering", "custom_kernel_ops", "llm"} <= set(edges)  # the walk saw them
    cycles = sorted(p for p in edges if reaches(p, p, {p}))
    assert cycles == [], edges
    assert "lowering" not in edges.get("custom_kernel_ops", set())  # handlers live in lowering/


def test_the_llm_rooms_meet_only_in_the_contract():
    """llm/run/ reads what a program holds from its contract and llm/export/
    writes it: neither imports the other, so a new layer kind touches
    llm/export/ and the kernels only."""
    for room, other in (("run", "export"), ("export", "run")):
        paths = sorted((PACKAGE / "llm" / room).glob("*.py"))
        assert len(paths) > 5
        for path in paths:
            crossing = sorted(m for m in _imports(path) if m.startswith(f"executorch_mlx.llm.{other}"))
            assert crossing == [], f"llm/{room}/{path.name} imports {crossing}"


def test_no_library_module_assigns_to_another_modules_globals():
    """Nor the fuzzing harness (tests use explicit hooks: backend.rewrite_blobs)."""
    offenders = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "fuzzing").rglob("*.py")]:
        if GENERATED in path.read_text()[:300]:
            continue
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                while isinstance(t, ast.Attribute):
                    if isinstance(t.value, ast.Name) and t.value.id in imported:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                    t = t.value
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id in imported:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_nothing_points_outside_the_repository():
    """The sampling contract is docs/sampling.md; no file points at the
    workspace's shared folder next to the repository."""
    needle = "../" + "shared"  # (not spelled whole: this file would match)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    texts = {name: (ROOT / name).read_bytes() for name in listed if (ROOT / name).is_file()}
    assert [name for name, data in texts.items() if needle.encode() in data] == []
    assert (ROOT / "docs" / "sampling.md").is_file()
