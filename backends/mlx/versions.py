"""What `executorch-mlx --version` reports: the versions that matter when
reporting a problem, and the device MLX will run programs on."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def version_report() -> str:
    import mlx.core as mx

    return "\n".join([
        f"executorch-mlx {_version('executorch-mlx')}",
        f"executorch {_version('executorch')}",
        f"mlx {_version('mlx')} (device: {mx.default_device()})",
        f"torch {_version('torch')}",
    ])
