"""The `executorch-mlx` command run in the test's own process: what a user
sees of `python -m executorch_mlx.cli ARGS` (the exit status and both
streams), without the ~8-15 s a new process takes to import torch and
ExecuTorch on the 2-core CI machine.

`python -m executorch_mlx.cli` is `sys.exit(main())`: main's return value or
the SystemExit argparse raises (bad arguments: 2, --help: 0) is the status.
capfd reads file descriptors 1 and 2, so output of the native runtime is seen
as a process's pipes would see it. A new process also starts with no Python
warning filters of ours; main installs them, and they are taken back here.
A new process is still run where that is the point, warnings printed as
modules are imported included: tests/test_container_fuzz.py (a generate
error is exactly one line on stderr) and tests/test_documented_commands.py
(the README's export and generate print only their own lines)."""

from __future__ import annotations

import os
import subprocess
import warnings


def cli(capfd, *args) -> subprocess.CompletedProcess:
    """main(args) run here: (returncode, stdout, stderr) as a process's."""
    from executorch_mlx.cli import main

    argv = [str(a) for a in args]
    capfd.readouterr()  # what the test printed before is not the command's
    progress_bars = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    with warnings.catch_warnings():
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage errors and --help
            code = e.code
    if progress_bars is None:  # main's setdefault, taken back
        os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    out, err = capfd.readouterr()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit(message): printed, status 1
        err, code = err + f"{code}\n", 1
    return subprocess.CompletedProcess(["executorch-mlx", *argv], code, out, err)
