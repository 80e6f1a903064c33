"""Hostile blobs: node arguments checked before MLX sees them, the memory
budget, and bounded fuzzing runs (every case in a worker process, so a crash
or a hang is counted, not fatal). The long runs: scripts/fuzz_blobs.py."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import torch
from harness import run

import executorch_mlx
from executorch_mlx._runtime_library import clear_last_error, last_error
from fuzzing import graphs, hostile, mutate, runner, sketch
from fuzzing.sketch import F32, I64, Sketch, sizes
from executorch_mlx.serialization import ir


def _refusal(graph: ir.Graph) -> str:
    """Loads and runs `graph`; returns our runtime's reason for refusing it."""
    return _refusal_of(sketch.wrap(graph))


def _refusal_of(pte: bytes) -> str:
    clear_last_error()  # so the reason read below is this run's
    with pytest.raises(RuntimeError, match=r"Failed to load method forward|method->execute\(\) failed"):
        run(pte, list(sketch.INPUTS))
    return last_error()


# ------------------------------------------------------ argument checks --
def _with(build, **fields):
    """A one-node graph over x from `build(sketch)`, its op's fields replaced."""
    s = Sketch()
    out, rank = build(s)
    for k, v in fields.items():
        setattr(s.graph.nodes[-1].op, k, v)
    return s.finish(out, rank)


def _sum(s):
    return s.op(ir.SumNode, a=s.x, axes=[1]), 2


def _argmax(s):
    return s.op(ir.ArgmaxNode, a=s.x, axis=1), 2


def _transpose(s):
    return s.op(ir.TransposeNode, a=s.x, axes=[2, 0, 1]), 3


def _expand(s):
    return s.op(ir.ExpandDimsNode, a=s.x, axes=[0]), 4


def _slice(s):
    return s.op(ir.SliceNode, a=s.x, start=[0, 0, 0], stop=[2, 3, 4], strides=[1, 1, 1]), 3


def _reshape(s):
    return s.op(ir.ReshapeNode, a=s.x, shape=sizes(6, 4)), 2


def _concat(s):
    return s.op(ir.ConcatenateNode, inputs=[s.x, s.y], axis=0), 3


def _bits(s):
    return s.op(ir.RandomBitsNode, shape=sizes(2, 2), width=4), 2


def _matmul(s):
    return s.op(ir.MatmulNode, a=s.x, b=s.op(ir.TransposeNode, a=s.y, axes=[0, 2, 1])), 3


def _shift(s):
    return s.op(ir.RightShiftNode, a=s.i, b=s.lit(1, I64)), 2


def _arange(s):
    return s.op(ir.ArangeNode, start=0.0, stop=4.0, step=1.0, dtype=F32), 1


ARGUMENT_CASES = {
    "axis beyond the rank": (_sum, dict(axes=[3]), "SumNode.axes: axis 3 out of range for rank 3"),
    "negative axis beyond the rank": (_sum, dict(axes=[-4]), "SumNode.axes: axis -4 out of range for rank 3"),
    "repeated axis": (_sum, dict(axes=[1, -2]), "SumNode.axes: axis -2 repeated"),
    "scalar axis": (_argmax, dict(axis=2**31 - 1), "ArgmaxNode.axis: axis 2147483647 out of range for rank 3"),
    "not a permutation": (_transpose, dict(axes=[0, 1]), "TransposeNode.axes: 2 entries for rank 3"),
    "new axis beyond the result": (_expand, dict(axes=[4]), "ExpandDimsNode.axes: axis 4 out of range for rank 4"),
    "slice bounds per axis": (_slice, dict(start=[0, 0]), "SliceNode.start: 2 entries for rank 3"),
    "zero stride": (_slice, dict(strides=[1, 0, 1]), "SliceNode.strides: a stride is 0"),
    "reshape to another size": (_reshape, dict(shape=sizes(5, 4)), "ReshapeNode.shape: shape of 20 elements for a value of 24"),
    "negative size": (_reshape, dict(shape=sizes(-6, -4)), "dimension -6 outside [0, 2147483647]"),
    "concatenate axis of a list": (_concat, dict(axis=3), "ConcatenateNode.axis: axis 3 out of range for rank 3"),
    "width not 1, 2 or 4": (_bits, dict(width=3), "RandomBitsNode.width: 3 is not one of 1 2 4"),
    "integer matmul": (_matmul, dict(a=ir.Tid(2)), "MatmulNode.a: dtype int64 where a floating point one is needed"),
    "float shift": (_shift, dict(a=ir.Tid(0)), "RightShiftNode.a: dtype float32 where a integer one is needed"),
    "bool arange": (_arange, dict(dtype=ir.DType.bool_), "ArangeNode.dtype: dtype bool where a numeric one is needed"),
    "enum outside DType": (_arange, dict(dtype=99), "dtype 99 is not a DType"),
}


@pytest.mark.parametrize("name", list(ARGUMENT_CASES))
def test_bad_node_arguments_are_refused_naming_the_field(name):
    build, fields, reason = ARGUMENT_CASES[name]
    run(sketch.wrap(_with(build)), list(sketch.INPUTS))  # the unchanged graph runs
    assert reason in _refusal(_with(build, **fields))


def test_every_attribute_of_the_schema_has_a_case():
    """A check added to the schema gets a case here (attribute -> its cases)."""
    covered = {"axis": "axis beyond the rank", "new_axis": "new axis beyond the result",
               "permutation": "not a permutation", "per_axis": "slice bounds per axis", "stride": "zero stride",
               "numel": "reshape to another size", "one_of": "width not 1, 2 or 4", "kind": "integer matmul"}
    schema = Path(ir.__file__).with_name("schema.fbs")
    declared = {line.split('"')[1] for line in open(schema) if line.startswith("attribute ")}
    # not checks: code generation, and the sampler table's columns (SampleNode)
    table = {"sampler", "dtype", "off", "off_means", "valid", "needs", "together", "help", "cli", "openai"}
    assert declared - {"mlx", "custom", "shape"} - table == set(covered)
    assert set(covered.values()) <= set(ARGUMENT_CASES)


def test_a_slot_written_twice_and_more_slots_than_the_blob_holds_are_refused():
    s = Sketch()
    out = s.op(ir.AddNode, a=s.x, b=s.y)
    g = s.finish(out, 3)
    g.nodes[1].op.out = out  # AsTypeNode overwrites the AddNode's slot
    assert "value slot 3 is written twice" in _refusal(g)
    g = s.finish(s.op(ir.AddNode, a=s.x, b=s.y), 3)
    g.num_values = sketch.BLOB_SIZE // 4 + 1
    assert f"{g.num_values} value slots: more than a blob of {sketch.BLOB_SIZE} bytes can define" in _refusal(g)


def test_scatter_updates_must_be_one_wide_along_the_written_axis():
    """MLX checks only that the update slice fits the array: a slice 2 wide
    written at the last index would write past it."""
    s = Sketch()
    idx = s.op(ir.ArangeNode, start=2.0, stop=3.0, step=1.0, dtype=I64)
    out = s.op(ir.ScatterNode, a=s.x, indices=[idx], updates=s.full([1, 2, 2, 4], 1.0), axes=[1])
    assert "ScatterNode: updates must be [*indices shape, *slice of a], the slice 1 along axes" in _refusal(
        s.finish(out, 3))


def _empty_scatter_updates():
    s = Sketch()
    idx = s.op(ir.ArangeNode, start=0.0, stop=0.0, step=1.0, dtype=I64)
    return s.finish(s.op(ir.ScatterNode, a=s.x, indices=[idx], updates=s.full([0, 2, 1, 4], 1.0), axes=[1]), 3)


def _empty_random_rows():
    s = Sketch()
    return s.finish(s.op(ir.RandomBitsNode, shape=sizes(0, 2), seed=s.lit(1, I64), position=s.lit(0, I64)), 2)


def _empty_quantized_rows():
    q = graphs.quantized_linear()
    q.nodes[0].op.shape[0] = ir.IntOrSlot(value=0, slot=-1)  # x: [0, 64]
    return q


def _empty_expert_rows():
    """No rows through int4 experts (our kernel sizes its work by the experts chosen)."""
    s = Sketch()
    q = graphs._quantized(s, rows=24)  # 3 experts of 8 rows
    q.update(weight=s.op(ir.ReshapeNode, a=q["weight"], shape=sizes(3, 8, 8)),
             **{k: s.op(ir.ReshapeNode, a=q[k], shape=sizes(3, 8, 2)) for k in ("scales", "biases")})
    out = s.op(ir.GatherQuantizedLinearNode, x=s.full([0, 64], 1.0), indices=s.full([0, 2], 0, I64), **q)
    return s.finish(out, 3)


# Empty values MLX would divide by zero on (SIGFPE), and what each must give.
EMPTY = {"empty scatter updates": (_empty_scatter_updates, sketch.INPUTS[0].sum()),
         "empty random rows": (_empty_random_rows, torch.tensor(0.0)),
         "empty quantized rows": (_empty_quantized_rows, torch.tensor(0.0)),
         "empty expert rows": (_empty_expert_rows, torch.tensor(0.0))}


@pytest.mark.parametrize("name", list(EMPTY))
def test_empty_values_run_where_mlx_would_divide_by_zero(name):
    build, want = EMPTY[name]
    (got,) = run(sketch.wrap(build()), list(sketch.INPUTS))
    torch.testing.assert_close(got, want)


# --------------------------------------------------------- memory budget --
STRUCTURED = 4 * len(graphs.GRAPHS)


@pytest.fixture(scope="module", params=["native", "mlx-ops"])
def sketch_report(request):
    """One worker run per device path (the native CPU kernels, and the MLX
    ops that GPUs run): the seed graph of every node type, mutations of
    them, the empty values and the hostile blobs."""
    seeds, templates = runner.seed_cases()
    mutated, _ = runner.structured_cases(STRUCTURED, seed=7, max_changes=2)
    named = [runner.Case("sketch", sketch.pad(ir.serialize(build())), name)
             for name, build in [*hostile.REFUSED.items(), *((k, v[0]) for k, v in EMPTY.items())]]
    # a fixed budget, so the 8 and 16 GiB blobs are over it on any machine
    env = {"EMLX_MEMORY_BUDGET": "4G", **({"EMLX_DISABLE_CPU_KERNELS": "1"} if request.param == "mlx-ops" else {})}
    return runner.run_cases(seeds + mutated + named, templates, env=env)


def test_empty_values_run_on_both_device_paths(sketch_report):
    assert {name: sketch_report.by_label[name][0] for name in EMPTY} == dict.fromkeys(EMPTY, runner.RAN)


@pytest.mark.parametrize("name", list(hostile.REFUSED))
def test_hostile_blobs_are_refused_at_load(sketch_report, name):
    """The blobs issue 7 found: a stride of 0 (SIGFPE), a size past int32
    (silently truncated), 8-16 GiB values from tiny blobs, 2^24 value slots
    (a 5000x slower call): each refused at load with its reason, in a worker
    process that survives."""
    reasons = {
        "zero_stride": "SliceNode.strides: a stride is 0",
        "dimension_beyond_int32": "dimension 4294967301 outside [0, 2147483647]",
        "fill_8gib": "values alive at once reach 8.0 GiB (this output: 8.0 GiB), over the memory budget of 4.0 GiB",
        "matmul_8gib": "node 2 (MatmulNode): values alive at once reach 8.0 GiB",
        "arange_16gib": "node 0 (ArangeNode): values alive at once reach 16.0 GiB",
        "value_slots_2_24": "16777216 value slots: more than a blob of",
    }
    assert set(reasons) == set(hostile.REFUSED)
    outcome, reason = sketch_report.by_label[name]
    assert outcome == runner.LOAD and reasons[name] in reason, (outcome, reason)


def test_random_bits_for_many_rows_load_and_run():
    (got,) = run(sketch.wrap(hostile.random_bits_rows()), list(sketch.INPUTS))
    assert got > 0


def _hundred_mib() -> bytes:
    s = Sketch()
    return sketch.wrap(s.finish(s.full([25, 2**20], 1.0), 2))


@pytest.fixture
def budget(monkeypatch):
    """Sets EMLX_MEMORY_BUDGET (read at each load); restores the default."""
    yield lambda value: monkeypatch.setenv("EMLX_MEMORY_BUDGET", value)
    executorch_mlx.set_memory_budget(None)


@pytest.mark.parametrize("env,api,want", [
    ("64M", None, 64 << 20),
    ("0.0625 GiB", None, 64 << 20),
    ("1G", 64 << 20, 64 << 20),  # set_memory_budget wins over the variable
    ("64M", 1 << 30, 1 << 30),
])
def test_memory_budget_from_the_environment_or_the_api(budget, env, api, want):
    budget(env)
    if api:
        executorch_mlx.set_memory_budget(api)
    assert executorch_mlx.memory_budget() == want
    if want < 100 << 20:
        assert ("node 0 (FullNode): values alive at once reach 100.0 MiB (this output: 100.0 MiB), "
                "over the memory budget of 64.0 MiB (set EMLX_MEMORY_BUDGET") in _refusal_of(_hundred_mib())
    else:
        run(_hundred_mib(), list(sketch.INPUTS))


def test_the_default_budget_is_a_quarter_of_memory_and_a_bad_variable_is_named(monkeypatch, budget):
    monkeypatch.delenv("EMLX_MEMORY_BUDGET", raising=False)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        memory = min(memory, address_space)
    assert executorch_mlx.memory_budget() == memory // 4
    budget("lots")
    with pytest.raises(ValueError, match="EMLX_MEMORY_BUDGET: memory size 'lots': expected bytes, a K/M/G/T suffix"):
        executorch_mlx.memory_budget()
    assert "EMLX_MEMORY_BUDGET: memory size 'lots'" in _refusal_of(_hundred_mib())
    with pytest.raises(ValueError, match="memory budget must be a positive int of bytes or None, got -1"):
        executorch_mlx.set_memory_budget(-1)


def test_state_beyond_the_budget_is_refused_before_it_is_allocated():
    s = Sketch()
    buf = s.state([2**20, 2**20])  # a 4 TiB KV cache from a few bytes
    s.update(buf, s.op(ir.AddNode, a=buf, b=s.lit(1.0)))
    assert "mutable buffers of 4096.0 GiB exceed the memory budget of" in _refusal(s.finish(s.x, 3))


class Wide(torch.nn.Module):
    """Counts its calls in a buffer; each batch row makes a 512 MiB value."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.copy_(self.calls + 1)
        return (x[:, :, None] * torch.ones(1, 1, 128)).amax() + self.calls


def test_budget_at_execute_for_dynamic_shapes_keeps_the_state():
    """With a dynamic batch the sizes are known only per call: a call over the
    budget is refused before anything is allocated, the state (the call
    count, as a KV cache would be) is untouched, and the next call runs."""
    from harness import lower

    x = torch.ones(2, 2**20)
    edge = lower(Wide(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("b", min=1, max=8)}})
    executorch_mlx.set_memory_budget(1 << 30)  # the dry run at load (batch 1: 512 MiB) fits
    try:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(edge.to_executorch().buffer)
        method = program.load_method("forward")
    finally:
        executorch_mlx.set_memory_budget(None)
    assert float(method.execute([x[:1]])[0]) == 1 + 1
    clear_last_error()
    with pytest.raises(RuntimeError, match=r"method->execute\(\) failed"):
        method.execute([torch.ones(4, 2**20)])  # 2 GiB
    assert "values alive at once reach 2.0 GiB" in last_error() and "over the memory budget of 1.0 GiB" in last_error()
    assert float(method.execute([x[:1]])[0]) == 1 + 2


class WideAfterAProduct(Wide):
    """Wide, after a matrix product: evaluation starts while its graph is
    still being built (interpreter.cpp, Liveness::evaluate_after)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2**20, 2, bias=False)

    def forward(self, x):
        self.calls.copy_(self.calls + 1)
        wide = (self.proj(x)[:, :, None] * torch.ones(1, 1, 2**26)).amax()
        return wide + self.calls


def test_budget_refused_after_evaluation_started_resets_the_state_and_says_so():
    """The state may have been updated in place by then: it goes back to its
    initial value (the call count starts over), as after a failed evaluation."""
    from harness import lower

    x = torch.ones(2, 2**20)
    edge = lower(WideAfterAProduct(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("b", min=1, max=8)}})
    executorch_mlx.set_memory_budget(1 << 30)  # batch 1's 512 MiB (and the weight) fit
    try:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(edge.to_executorch().buffer)
        method = program.load_method("forward")
    finally:
        executorch_mlx.set_memory_budget(None)
    assert float(method.execute([torch.zeros(1, 2**20)])[0]) == 1
    assert float(method.execute([torch.zeros(1, 2**20)])[0]) == 2
    clear_last_error()
    with pytest.raises(RuntimeError, match=r"method->execute\(\) failed"):
        method.execute([torch.zeros(4, 2**20)])  # 2 GiB
    assert "values alive at once reach" in last_error() and "state (KV cache) was reset" in last_error()
    assert float(method.execute([torch.zeros(1, 2**20)])[0]) == 1


# ---------------------------------------------------------------- fuzzing --
def test_every_node_type_has_a_seed_graph_that_runs(sketch_report):
    assert set(ir.OP_TYPES) <= {getattr(ir, name, None) for name in graphs.GRAPHS}
    assert {name: sketch_report.by_label[name][0] for name in graphs.GRAPHS} == dict.fromkeys(graphs.GRAPHS, runner.RAN)


def test_mutations_cover_every_field_of_a_node():
    g = graphs.GRAPHS["SliceNode"]()
    touched = {m.path[3] for m in mutate.mutations(g) if m.path[:3] == ("nodes", 0, "op") and len(m.path) > 3}
    assert touched == {"a", "start", "stop", "strides", "out"}
    m = mutate.Mutation(("nodes", 0, "op", "strides", 1), 0)
    assert mutate.apply(g, m).nodes[0].op.strides == [1, 0, 2] and g.nodes[0].op.strides == [1, 1, 2]


def _assert_survived(report: runner.Report, count: int) -> None:
    assert sum(report.outcomes.values()) == count
    assert report.failures == [], report.failures  # crashed or hung
    assert report.unexplained == [], report.unexplained  # refused, but not by our runtime
    # the mutations reach every stage: verification, the dry run, execution
    assert min(report.outcomes[k] for k in (runner.LOAD, runner.EXECUTE, runner.RAN)) > 0, report.outcomes


def test_structured_mutations_of_every_node_type_never_crash(sketch_report):
    mutated = [label for label in sketch_report.by_label if ": " in label and not label.startswith("empty")]
    assert len(mutated) == STRUCTURED and {label.split(":")[0] for label in mutated} == set(graphs.GRAPHS)
    _assert_survived(sketch_report, len(sketch_report.by_label))


def test_byte_mutations_of_real_programs_never_crash():
    templates = runner.real_program_templates()
    report = runner.run_cases(runner.byte_cases(templates, 200, seed=7), templates, env={"EMLX_MEMORY_BUDGET": "4G"})
    _assert_survived(report, 200)


def test_a_crash_or_a_hang_is_counted_not_fatal():
    """The runner's own guarantee: a worker that dies or stalls is replaced
    (tests/fuzz_selftest_worker.py makes the cases so labelled do that)."""
    template = sketch.sketch_template()
    good = sketch.pad(ir.serialize(graphs.GRAPHS["AddNode"]()))
    cases = [runner.Case("sketch", good, "before"), runner.Case("sketch", good, "crash"),
             runner.Case("sketch", good, "hang"), runner.Case("sketch", good, "after")]
    report = runner.run_cases(cases, {"sketch": template}, timeout=2, worker="fuzz_selftest_worker",
                              path=(str(Path(__file__).parent),))
    assert {k: v[0] for k, v in report.by_label.items()} == {
        "before": runner.RAN, "crash": runner.CRASHED, "hang": runner.HUNG, "after": runner.RAN}
