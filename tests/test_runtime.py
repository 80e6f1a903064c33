"""The C++ runtime: registration, blob verification, input checks, threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from harness import delegate_graphs, lower, run, undelegated_ops

import executorch_mlx
from executorch_mlx import backend as backend_module
from executorch_mlx._runtime_library import last_error
from executorch_mlx.serialization import ir


class AddMul(torch.nn.Module):
    def forward(self, x, y):
        return (x + y) * x


ARGS = (torch.randn(2, 3), torch.randn(2, 3))


def test_backend_is_registered_in_a_fresh_process():
    code = (
        "import executorch_mlx, executorch.runtime as r;"
        "print(r.Runtime.get().backend_registry.registered_backend_names)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert executorch_mlx.BACKEND_ID in out
    # the C++ plugin registers the very id the Python backend lowers for
    from executorch_mlx._runtime_library import load

    assert load().emlx_backend_id().decode() == executorch_mlx.BACKEND_ID


def test_loading_the_plugin_starts_no_openblas_threads():
    """OpenBLAS, loaded with the plugin, would start a thread per further
    core that spins for about 0.1 s: importing the package starts as many
    threads as with OPENBLAS_NUM_THREADS=1 set, and leaves the environment
    as it found it."""
    code = "import os, executorch_mlx; print(len(os.listdir('/proc/self/task')), 'OPENBLAS_NUM_THREADS' in os.environ)"
    unset = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    threads = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=env).stdout.split() for env in (unset, unset | {"OPENBLAS_NUM_THREADS": "1"})]
    assert threads[0] == [threads[1][0], "False"]


def test_running_a_program_needs_no_export_stack(tmp_path):
    """Importing the package and running a .pte leave ExecuTorch's export
    stack unimported (it costs seconds of start-up). (That the export side
    imports on first use after it, every test that lowers shows.)"""
    path = tmp_path / "addmul.pte"
    path.write_bytes(lower(AddMul(), ARGS).to_executorch().buffer)
    code = f"""
import sys, torch, executorch_mlx
from executorch.runtime import Runtime
method = Runtime.get().load_program({str(path)!r}).load_method("forward")
print(method.execute([torch.ones(2, 3), torch.full((2, 3), 2.0)])[0].tolist())
print("executorch.exir" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == [str([[3.0] * 3] * 2), "False"]
    assert executorch_mlx.MLXGraphBackend.__name__ == executorch_mlx.BACKEND_ID


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no other to step aside to")
def test_running_leaves_the_callers_cpu_affinity_as_it_was(tmp_path):
    """The thread that builds a graph steps off the CPU of MLX's stream
    thread, and during a call each is kept to CPUs of its own
    (kernels/thread_pool.h: KeptApart). Forced here: the stream thread is
    made while the main thread may run on one CPU only, so it stays there,
    and the main thread, free afterwards, starts on that CPU too. After
    every call, paused or not, every thread's affinity is what it was (the
    stream thread's: that one CPU), and the results are right."""
    path = tmp_path / "linear.pte"
    linear = torch.nn.Linear(1024, 2048)
    x = torch.randn(1, 1024)
    path.write_bytes(lower(linear, (x,)).to_executorch().buffer)
    torch.save({"x": x, "want": linear(x).detach()}, tmp_path / "io.pt")
    code = f"""
import os, time, torch, executorch_mlx
from executorch.runtime import Runtime
io = torch.load({str(tmp_path / "io.pt")!r})
cpus = os.sched_getaffinity(0)
first = min(cpus)
os.sched_setaffinity(0, {{first}})
method = Runtime.get().load_program({str(path)!r}).load_method("forward")
method.execute([io["x"]])  # (the calling thread's MLX stream starts on its first call)
tasks = [int(t) for t in os.listdir("/proc/self/task")]
print(sum(os.sched_getaffinity(t) == {{first}} for t in tasks) > 1)
os.sched_setaffinity(0, cpus)
masks = {{t: os.sched_getaffinity(t) for t in tasks}}
same = True
for pause in (0, 0.06, 0, 0.01, 0.06):
    time.sleep(pause)
    torch.testing.assert_close(method.execute([io["x"]])[0], io["want"], atol=1e-4, rtol=1e-4)
    same = same and all(os.sched_getaffinity(t) == mask for t, mask in masks.items())
print(same)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


class Products(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to keep apart")
def test_a_call_keeps_the_stream_thread_and_the_caller_on_cpus_of_their_own(tmp_path):
    """From a thread's second call on (its first finds its stream thread),
    MLX's stream thread may run on one CPU only and the caller only on the
    others while the call runs (kernels/thread_pool.h: KeptApart); after
    it both are as they were. Watched from another thread, which runs
    while the call does (our runner's calls release the GIL)."""
    path = tmp_path / "products.pte"
    model, x = Products(), torch.randn(1024, 1024)
    path.write_bytes(lower(model, (x,)).to_executorch().buffer)
    code = f"""
import os, threading, time
import numpy as np
from executorch_mlx.loaded_program import LoadedProgram
method = LoadedProgram({str(path)!r}).load_method("forward")
x = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
method.execute([x])
main, cpus = threading.get_native_id(), os.sched_getaffinity(0)
seen, done = [], threading.Event()
def watch():
    while not done.is_set():
        masks = {{int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}}
        own = [m for t, m in masks.items() if t != main and len(m) == 1 and m < cpus]
        seen.extend(m for m in own if masks[main] == cpus - m)
        time.sleep(0.0005)
watcher = threading.Thread(target=watch)
watcher.start()
for _ in range(3):
    method.execute([x])
done.set()
watcher.join()
print(bool(seen), os.sched_getaffinity(0) == cpus)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


class Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_loaded_program_reads_and_writes_bfloat16_as_float32():
    """Our runners' loader (loaded_program.py) speaks numpy, which has no
    bfloat16: a float32 input is rounded to it as torch rounds (to nearest,
    ties to even), a torch bfloat16 tensor is taken as it is, and a bfloat16
    output comes back widened."""
    import numpy as np

    from executorch_mlx.loaded_program import BFLOAT16, LoadedProgram

    # ties at bfloat16's precision (1 + 2**-8 and 1 + 3 * 2**-8), one below, large and tiny values
    x = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -3.3e38 / 2], [1e-30, -7.77, 0.0, 123456.0]])
    method = LoadedProgram(lower(Twice(), (x.bfloat16(),)).to_executorch().buffer).load_method("forward")
    assert method.inputs[0] == (BFLOAT16, (2, 4)) and method.outputs[0] == (BFLOAT16, (2, 4))
    want = (x.bfloat16() * 2).float().numpy()
    for given in (x.numpy(), x.bfloat16()):
        got = method.execute([given])[0]
        assert got.dtype == np.float32 and np.array_equal(got, want), (given, got, want)


class Next(torch.nn.Module):
    def forward(self, ids):
        return ids + 1


def test_a_loaded_program_casts_inputs_within_their_kind_only():
    """An int32 array feeds an int64 input; floats never become token ids."""
    import numpy as np

    from executorch_mlx.loaded_program import LoadedProgram

    method = LoadedProgram(lower(Next(), (torch.tensor([1, 2]),)).to_executorch().buffer).load_method("forward")
    assert method.execute([np.array([4, 5], dtype=np.int32)])[0].tolist() == [5, 6]
    assert method.execute([[7, 8]])[0].tolist() == [8, 9]
    with pytest.raises(TypeError, match="input 0 takes int64, got float32"):
        method.execute([np.array([4.5, 5.0], dtype=np.float32)])


def test_a_loaded_program_reads_an_array_given_again_afresh():
    """A decode loop passes the sampler's arrays again, as they are: their
    contents are read at each call, a converted array's too, and an array
    whose shape or dtype changed in place is checked again."""
    import numpy as np

    from executorch_mlx.loaded_program import LoadedProgram

    method = LoadedProgram(lower(Next(), (torch.tensor([1, 2]),)).to_executorch().buffer).load_method("forward")
    x, y = np.array([1, 2]), np.array([1, 2], dtype=np.int32)
    assert method.execute([x])[0].tolist() == [2, 3]
    x[:] = [10, 20]
    assert method.execute([x])[0].tolist() == [11, 21]
    assert method.execute([y])[0].tolist() == [2, 3]
    y[:] = [5, 6]
    assert method.execute([y])[0].tolist() == [6, 7]
    x.dtype = np.float64
    with pytest.raises(TypeError, match="input 0 takes int64, got float64"):
        method.execute([x])
    x.dtype = np.int64
    assert method.execute([x])[0].tolist() == [11, 21]
    x.shape = (2, 1)
    with pytest.raises(RuntimeError):
        method.execute([x])


def _pte_with_blob(mutate) -> bytes:
    """Lowers AddMul with `mutate(graph, blob) -> blob` applied at preprocess
    (mutators re-serialize an edited graph)."""
    with backend_module.rewrite_blobs(mutate):
        return lower(AddMul(), ARGS).to_executorch().buffer


def _bump_version(g, blob):
    g.version = ir.SCHEMA_VERSION + 1
    return ir.serialize(g)


def _node_reads_out_of_range(g, blob):
    g.nodes[0].op.a = ir.Tid(10_000)
    return ir.serialize(g)


def _output_out_of_range(g, blob):
    g.outputs[0].slot = g.num_values + 5
    return ir.serialize(g)


def _read_before_write(g, blob):
    g.nodes[0].op.a = g.nodes[-1].op.out
    return ir.serialize(g)


def _bad_rank(g, blob):
    # AddNode of [2, 3] and [5]: MLX cannot broadcast; caught at load time
    g.literals.append(ir.Literal(slot=g.num_values, dtype=ir.DType.float32, float_value=1.0))
    g.nodes.insert(0, ir.Node(op=ir.FullNode(shape=[ir.IntOrSlot(5, -1)], value=ir.Tid(g.num_values),
                                             dtype=ir.DType.float32, out=ir.Tid(g.num_values + 1))))
    g.nodes[1].op.b = ir.Tid(g.num_values + 1)
    g.num_values += 2
    return ir.serialize(g)


def _huge_value(g, blob):
    # a [2^30, 2^20] float32 fill (4 PiB): must be refused, not allocated
    g.literals.append(ir.Literal(slot=g.num_values, dtype=ir.DType.float32, float_value=1.0))
    n = g.num_values
    shape = [ir.IntOrSlot(1 << 30, -1), ir.IntOrSlot(1 << 20, -1)]
    g.nodes.append(ir.Node(op=ir.FullNode(shape=shape, value=ir.Tid(n), dtype=ir.DType.float32, out=ir.Tid(n + 1))))
    g.nodes.append(ir.Node(op=ir.SumNode(a=ir.Tid(n + 1), axes=[0, 1], out=ir.Tid(n + 2))))
    g.nodes.append(ir.Node(op=ir.AddNode(a=ir.Tid(g.outputs[0].slot), b=ir.Tid(n + 2), out=ir.Tid(n + 3))))
    g.outputs[0].slot = n + 3
    g.num_values += 4
    return ir.serialize(g)


def _zero_stride(g, blob):
    # MLX divides by slice strides (SIGFPE on 0): refused before MLX sees it
    n = g.num_values
    g.nodes.append(ir.Node(op=ir.SliceNode(a=ir.Tid(g.outputs[0].slot), start=[0, 0], stop=[2, 3], strides=[1, 0],
                                           out=ir.Tid(n))))
    g.outputs[0].slot = n
    g.num_values += 1
    return ir.serialize(g)


def _dimension_beyond_int32(g, blob):
    # MLX's shapes are int32: a 2^32 + 5 fill must not be truncated to 5
    g.literals.append(ir.Literal(slot=g.num_values, dtype=ir.DType.float32, float_value=1.0))
    n = g.num_values
    g.nodes.append(ir.Node(op=ir.FullNode(shape=[ir.IntOrSlot(2**32 + 5, -1)], value=ir.Tid(n),
                                          dtype=ir.DType.float32, out=ir.Tid(n + 1))))
    g.outputs.append(ir.IOValue(slot=n + 1, dtype=ir.DType.float32, shape=[ir.Dim(size=5, symbol=-1)]))
    g.num_values += 2
    return ir.serialize(g)


CORRUPTIONS = {
    "truncated": (lambda g, blob: blob[: len(blob) // 2], "verification failed"),
    "wrong identifier": (lambda g, blob: blob[:4] + b"NOPE" + blob[8:], "wrong file identifier"),
    "garbage": (lambda g, blob: bytes(range(256)) * 4, "identifier"),
    "tiny": (lambda g, blob: b"\x00\x01", "too small"),
    "future version": (_bump_version, "newer than this runtime"),
    "node id out of range": (_node_reads_out_of_range, "out of range"),
    "output id out of range": (_output_out_of_range, "never written"),
    "read before write": (_read_before_write, "before it is written"),
    "shapes do not broadcast": (_bad_rank, "graph does not build"),
    "value beyond the memory limit": (_huge_value, "exceeds MLX's memory limit"),
    "zero slice stride": (_zero_stride, "a stride is 0"),
    "dimension beyond int32": (_dimension_beyond_int32, "dimension 4294967301 outside"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_blob_is_refused_cleanly(name):
    mutate, reason = CORRUPTIONS[name]
    pte = _pte_with_blob(mutate)
    with pytest.raises(RuntimeError, match="Failed to load method forward"):
        run(pte, list(ARGS))
    assert reason in last_error(), last_error()


def test_intact_blob_still_runs():
    pte = _pte_with_blob(lambda g, blob: blob)
    x, y = ARGS
    torch.testing.assert_close(run(pte, [x, y])[0], (x + y) * x)


@pytest.mark.parametrize(
    "bad_inputs",
    [
        [ARGS[0].double(), ARGS[1]],  # dtype
        [torch.randn(3, 3), ARGS[1]],  # shape
        [ARGS[0]],  # count
    ],
    ids=["dtype", "shape", "count"],
)
def test_wrong_inputs_get_a_clean_error(bad_inputs):
    pte = lower(AddMul(), ARGS).to_executorch().buffer
    # ExecuTorch checks static inputs before any delegate runs
    with pytest.raises(RuntimeError, match=r"set_inputs\(\) for method 'forward' failed"):
        run(pte, bad_inputs)
    # the process is intact and the program still runs on good inputs
    torch.testing.assert_close(run(pte, list(ARGS))[0], (ARGS[0] + ARGS[1]) * ARGS[0])


def test_two_programs_run_from_two_threads():
    from executorch.runtime import Runtime

    class Mm(torch.nn.Module):
        def forward(self, x):
            return (x @ x.transpose(0, 1)).softmax(-1)

    programs = [lower(m, ARGS if i == 0 else (ARGS[0],)).to_executorch().buffer for i, m in enumerate([AddMul(), Mm()])]
    loaded = [Runtime.get().load_program(p) for p in programs]  # must outlive their Methods
    methods = [p.load_method("forward") for p in loaded]
    x, y = ARGS
    want = [(x + y) * x, (x @ x.T).softmax(-1)]
    errors = []

    def worker(i):
        try:
            for _ in range(50):
                inputs = [x, y] if i == 0 else [x]
                torch.testing.assert_close(methods[i].execute(inputs)[0], want[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_inputs_are_never_overwritten_by_buffer_reuse():
    """MLX donates a dying buffer to an elementwise result; a delegate input
    (ExecuTorch's memory) must never be donated, even when a portable op
    reads the same input after the delegate ran."""

    class Mixed(torch.nn.Module):
        def forward(self, x):
            y = ((x * 2.0).exp() + 1.0).neg()  # elementwise chain: donation candidates
            return y, torch.flip(x, dims=[-1])  # flip stays on portable kernels

    x = torch.randn(4, 1000)
    keep = x.clone()
    edge = lower(Mixed(), (x,))
    assert any("flip" in op for op in undelegated_ops(edge))
    got = run(edge.to_executorch().buffer, [x])
    want = Mixed()(keep)
    assert torch.equal(x, keep)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_dynamic_batch_crosses_the_delegate_boundary():
    class Dyn(torch.nn.Module):
        def forward(self, x):
            return (x * 2 + 1).softmax(-1).reshape(-1)

    batch = torch.export.Dim("batch", min=1, max=16)
    edge = lower(Dyn(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: batch}})
    (graph,) = delegate_graphs(edge)
    symbol = graph.symbols[graph.inputs[0].shape[0].symbol]
    # torch.export records min 2 for Dim(min=1) (it specializes sizes 0 and
    # 1 while tracing) but its programs accept 0 and 1: so does the runtime
    assert (symbol.min, symbol.max) == (0, 16)
    assert undelegated_ops(edge) == [], "the dynamic reshape is lowered"
    pte = edge.to_executorch().buffer
    for b in (1, 2, 7, 16):
        x = torch.randn(b, 8)
        torch.testing.assert_close(run(pte, [x])[0], Dyn()(x))
    # above the exported bound: ExecuTorch refuses it before the delegate runs
    with pytest.raises(RuntimeError, match=r"set_inputs\(\) for method 'forward' failed"):
        run(pte, [torch.randn(17, 8)])


LOAD_MEMORY_SCRIPT = """
import sys, torch, executorch_mlx
from executorch.runtime import Runtime
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
program = Runtime.get().load_program(sys.argv[1])
method = program.load_method("forward")
method.execute([torch.ones(4)])
print(rss() - before)
"""


def test_loading_holds_the_weights_once(tmp_path):
    """Loaded by path, a program's resident memory grows by its weights' size
    once: each weight is read into MLX's memory and ExecuTorch's mapping of
    it released (MLX's CPU allocator would copy a wrapped pointer, keeping both)."""

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16 * 2**20), requires_grad=False)  # 64 MiB

        def forward(self, x):
            return self.w[:4] + x

    pte = tmp_path / "big.pte"
    pte.write_bytes(lower(Big(), (torch.ones(4),)).to_executorch().buffer)
    grew = int(subprocess.run([sys.executable, "-c", LOAD_MEMORY_SCRIPT, str(pte)], check=True,
                              capture_output=True, text=True).stdout)
    assert 60 * 2**20 < grew < 1.25 * 64 * 2**20, f"resident memory grew by {grew / 2**20:.0f} MiB for 64 MiB"
