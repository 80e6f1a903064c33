"""What the CLI shows besides results: --version, the known third-party
warnings it hides (narrowly; --verbose hides nothing), and progress."""

from __future__ import annotations

import io
import logging
import warnings
from importlib.metadata import version

import pytest
import torch

from executorch_mlx import cli, third_party_warnings
from executorch_mlx.custom_kernel_ops.quantized import QuantFormat
from executorch_mlx.llm.export.quantize import quantize_model
from executorch_mlx.progress import CountingWriter, TerminalProgress, counter, shown_by

LEAF_SPEC = ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
             "treespec.is_leaf()` instead.")


def test_version_names_the_packages_and_mlx_device(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"executorch-mlx {version('executorch-mlx')}"
    assert lines[1] == f"executorch {version('executorch')}"
    assert lines[2].startswith(f"mlx {version('mlx')} (device: Device(")


@pytest.fixture
def hidden():
    """hide_known_warnings() for one test: Python warnings recorded, log
    records of the filtered loggers captured; both undone afterwards."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    loggers = [logging.getLogger(name) for name, _ in third_party_warnings.LOG_RECORDS]
    handler = Keep(logging.DEBUG)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        third_party_warnings.hide_known_warnings()
        for lg in loggers:
            lg.addHandler(handler)
        yield seen, records
    for lg in loggers:
        lg.removeHandler(handler)
        for f in [f for f in lg.filters if isinstance(f, third_party_warnings._DropMatching)]:
            lg.removeFilter(f)


def test_known_warnings_are_hidden_by_category_module_and_message(hidden):
    seen, records = hidden
    warnings.warn_explicit(LEAF_SPEC, FutureWarning, "copyreg.py", 105, module="copyreg")
    warnings.warn_explicit(LEAF_SPEC, FutureWarning, "_pytree.py", 1, module="torch.utils._pytree")
    # the same texts from our own modules, another category, or another message still show
    warnings.warn_explicit(LEAF_SPEC, FutureWarning, "hf_export.py", 1, module="executorch_mlx.llm.export.hf_export")
    warnings.warn_explicit(LEAF_SPEC, DeprecationWarning, "copyreg.py", 105, module="copyreg")
    warnings.warn_explicit("something else is deprecated", FutureWarning, "copyreg.py", 105, module="copyreg")
    assert [(w.category, w.filename) for w in seen] == [
        (FutureWarning, "hf_export.py"), (DeprecationWarning, "copyreg.py"), (FutureWarning, "copyreg.py")]

    logging.getLogger("torch.utils._pytree").warning(
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
        "release.")
    logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.abi3.so: not found")
    logging.getLogger("torchao").warning("Failed to load /x/site-packages/elsewhere/_C.so: not found")
    logging.getLogger("torchao").error("Failed to load /x/site-packages/torchao/_C.so: an error still shows")
    assert [r.getMessage() for r in records] == ["Failed to load /x/site-packages/elsewhere/_C.so: not found",
                                                 "Failed to load /x/site-packages/torchao/_C.so: an error still shows"]


@pytest.mark.parametrize("argv,hides", [(["inspect", "missing.pte"], True),
                                        (["--verbose", "inspect", "missing.pte"], False),
                                        (["inspect", "missing.pte", "--verbose"], False)])
def test_verbose_hides_nothing_and_errors_stay_one_line(monkeypatch, capsys, argv, hides):
    calls = []
    monkeypatch.setattr(third_party_warnings, "hide_known_warnings", lambda: calls.append(1))
    assert cli.main(argv) == 2
    assert bool(calls) == hides
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("executorch-mlx inspect: error: ") and "missing.pte" in err


@pytest.mark.parametrize("argv", [["--quiet", "export", "m", "-o", "x.pte"], ["export", "m", "-o", "x.pte", "--quiet"]])
def test_quiet_export_shows_no_progress(monkeypatch, capsys, argv):
    from executorch_mlx.llm.export import hf_export

    def fake_export(*args, progress, **kwargs):
        assert progress is None
        with counter("quantizing", 2) as count:
            count.advance(2)

    monkeypatch.setattr(hf_export, "export_llm", fake_export)
    assert cli.main(argv) == 0
    assert capsys.readouterr().err == ""


def _bar_output(live: bool) -> str:
    stream = io.StringIO()
    with TerminalProgress(stream, live=False) as display:  # ticker off: its timing is not under test
        display.live = live
        with shown_by(display):
            display.line("[   0.0 s] quantizing")
            quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8 * 8, 4)),
                           QuantFormat(4, 32))
            display.tick()
            out = io.BytesIO()
            with counter("writing", 3 * 2**20, "MiB", 2**20) as count:
                CountingWriter(out, count).write(bytes(3 * 2**20))
            assert len(out.getvalue()) == 3 * 2**20
    return stream.getvalue()


def test_progress_bars_on_a_terminal_only():
    shown = _bar_output(live=True)
    assert "quantizing to int4 group 32 [##############################] 2/2" in shown
    assert "writing [##############################] 3.0/3.0 MiB" in shown
    assert "s in this stage" in shown  # an uncounted stage shows its seconds
    assert shown.endswith("\r\x1b[K")  # the status line is erased at the end
    assert _bar_output(live=False) == "[   0.0 s] quantizing\n"


def test_counting_without_a_display_shows_nothing(capsys):
    with counter("nothing shown", 5) as count:
        count.advance(5)
    assert count.done == 5
    assert capsys.readouterr() == ("", "")
