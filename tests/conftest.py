import sys
from pathlib import Path

import pytest
import torch

# tests/ (harness, shared helpers) and the repository root (the fuzzing harness)
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
