"""The fuzzing harness of executorch-mlx (not part of the installed package):
seed graphs of every node type, mutations, hostile blobs, and a runner that
executes cases in worker processes. Used by tests/test_fuzz.py,
tests/test_container_fuzz.py and scripts/fuzz_blobs.py, hostile_blobs.py."""
