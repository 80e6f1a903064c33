"""The README example, the code generator's staleness check, and the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from cli_runs import cli
from harness import lower

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "mlx" / "serialization"))
import generate  # noqa: E402


def test_readme_lowering_example_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Lower a model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert float(printed.removeprefix("tensor(").split(",")[0].rstrip(")")) < 1e-5


def test_generated_files_are_fresh():
    assert generate.main(["--check"]) == 0


def test_check_detects_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "ir.py"
    stale.write_text(generate.OUTPUTS["ir.py"].read_text() + "\n# edited by hand\n")
    monkeypatch.setitem(generate.OUTPUTS, "ir.py", stale)
    assert generate.main(["--check"]) == 1


def test_schema_is_parsed_through_flatc():
    schema = generate.Schema(_bfbs())
    add = schema.obj("AddNode")
    assert add.attributes["mlx"] == "add"
    assert [f.name for f in add.fields] == ["a", "b", "out"]  # declaration order
    assert schema.file_ident == "EMLX"
    assert schema.nodes()[0].name == "AddNode"


def _bfbs() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([generate.flatc_binary(), "-b", "--schema", "--bfbs-builtins", "-o", tmp,
                        str(generate.SCHEMA)], check=True)
        return (Path(tmp) / "schema.bfbs").read_bytes()


def test_cli_inspect_prints_the_delegate_graph(tmp_path, capfd):
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x * 2.0, dim=-1)

    pte = tmp_path / "m.pte"
    pte.write_bytes(lower(M(), (torch.randn(2, 5),)).to_executorch().buffer)
    res = cli(capfd, "inspect", pte)
    assert res.returncode == 0, res.stderr
    assert "MLXGraphBackend" in res.stdout
    assert "input %" in res.stdout and "float32[2, 5]" in res.stdout
    assert "SoftmaxNode" in res.stdout and "MultiplyNode" in res.stdout


def test_the_partitioner_and_inspect_say_why_an_op_stayed_outside(tmp_path, capfd):
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx import MLXPartitioner

    class M(torch.nn.Module):
        def forward(self, x):  # sort has no handler; float64 has no MLX dtype
            return torch.sort(x).values * 2 + x.to(torch.float64).float()

    partitioner = MLXPartitioner()
    edge = to_edge_transform_and_lower(torch.export.export(M(), (torch.randn(5),)), partitioner=[partitioner])
    assert ("aten.sort.default", "no MLX handler for this op") in partitioner.outside
    assert ("dim_order_ops._to_dim_order_copy.default", "dtype torch.float64") in partitioner.outside
    pte = tmp_path / "m.pte"
    pte.write_bytes(edge.to_executorch().buffer)
    res = cli(capfd, "inspect", pte)
    assert res.returncode == 0, res.stderr
    assert "runs outside the delegates: aten::sort.values (no MLX handler for this op)" in res.stdout
    assert "_to_dim_order_copy.out (an MLX handler refused this use; export printed why)" in res.stdout
