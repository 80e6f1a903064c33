"""A fuzz worker whose cases labelled "crash" abort and "hang" sleep: how
tests/test_fuzz.py checks that the runner counts crashes and hangs."""

from __future__ import annotations

import os
import time

from fuzzing import runner


def _misbehave(case: runner.Case) -> None:
    if case.label == "crash":
        os.abort()
    if case.label == "hang":
        time.sleep(3600)


def worker_main() -> None:
    runner.worker_main(before_case=_misbehave)
