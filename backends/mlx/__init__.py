from ._runtime_library import load as _load_runtime
