"""Views, layout changes, indexing and concatenation."""

from __future__ import annotations

import math
import operator

import torch

from ..serialization import ir
from .builder import GraphBuilder, ir_dtype, meta_val, node_arg
from .registry import Unsupported, handles
from .sizes import same_shape, same_size

aten = torch.ops.aten


def _is_static(d) -> bool:
    return not isinstance(d, torch.SymInt)


@handles(aten.view_copy.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def reshape(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.bind(node, b.reshape(b.get(node.args[0]), tuple(meta_val(node).shape)))


@handles(operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg, torch.sym_min,
         torch.sym_max)
def size_arithmetic(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Arithmetic on sizes (seq - rows): a 0-d int64 value computed from
    the delegate's input sizes, like the sizes themselves."""
    val = meta_val(node)
    if not isinstance(val, torch.SymInt):
        raise Unsupported("Python arithmetic on values that are not sizes")
    b.bind(node, b.sym_value(val))


@handles(aten.sym_size.int)
def sym_size(b: GraphBuilder, node: torch.fx.Node) -> None:
    """A dimension's size, as a 0-d int64 value (consumers that take sizes
    read the symbol itself from node metadata)."""
    b.bind(node, b.sym_value(meta_val(node)))


def _transpose(b: GraphBuilder, node: torch.fx.Node, perm) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    b.bind(node, b.emit(ir.TransposeNode, x.dtype, out.shape, a=x.tid, axes=list(perm)))


@handles(aten.permute_copy.default, aten.permute.default)
def permute(b: GraphBuilder, node: torch.fx.Node) -> None:
    rank = len(meta_val(node).shape)
    _transpose(b, node, [d % rank for d in node.args[1]])


@handles(aten.transpose_copy.int, aten.transpose.int)
def transpose(b: GraphBuilder, node: torch.fx.Node) -> None:
    rank = len(meta_val(node).shape)
    perm = list(range(rank))
    i, j = node.args[1] % rank, node.args[2] % rank
    perm[i], perm[j] = perm[j], perm[i]
    _transpose(b, node, perm)


@handles(aten.t_copy.default, aten.t.default)
def t(b: GraphBuilder, node: torch.fx.Node) -> None:
    _transpose(b, node, list(range(len(meta_val(node).shape)))[::-1])


@handles(aten.unsqueeze_copy.default, aten.unsqueeze.default)
def unsqueeze(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    axis = node.args[1] % len(out.shape)
    b.bind(node, b.emit(ir.ExpandDimsNode, x.dtype, out.shape, a=x.tid, axes=[axis]))


@handles(aten.squeeze_copy.dims, aten.squeeze_copy.dim, aten.squeeze_copy.default,
         aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default)
def squeeze(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    rank = len(x.shape)
    dims = node_arg(node, 1, "dim", list(range(rank)))
    dims = [dims] if isinstance(dims, int) else dims
    # torch ignores dims whose size is not 1
    axes = sorted({d % rank for d in dims if x.shape[d % rank] == 1}) if rank else []
    if not axes:
        b.bind(node, x)
        return
    b.bind(node, b.emit(ir.SqueezeNode, x.dtype, out.shape, a=x.tid, axes=axes))


@handles(aten.expand_copy.default, aten.expand.default)
def expand(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    if same_shape(x.shape, out.shape):  # (a causal mask's expand to the shape it has)
        b.bind(node, x)
        return
    b.bind(node, b.emit(ir.BroadcastToNode, x.dtype, out.shape, a=x.tid, shape=b.dims(out.shape)))


@handles(aten.repeat.default)
def repeat(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x tiled `repeats` times along each axis (repeats may add leading axes):
    each axis of size d becomes [1, d], broadcast to [r, d], then merged."""
    x, repeats = b.get(node.args[0]), list(node.args[1])
    if not all(isinstance(r, int) for r in repeats):
        raise Unsupported("repeat by a dynamic count")
    dims = [1] * (len(repeats) - len(x.shape)) + list(x.shape)
    x = b.reshape(x, tuple(d for dim in dims for d in (1, dim)))
    wide = tuple(d for r, dim in zip(repeats, dims) for d in (r, dim))
    x = b.emit(ir.BroadcastToNode, x.dtype, wide, a=x.tid, shape=b.dims(wide))
    b.bind(node, b.reshape(x, tuple(meta_val(node).shape)))


@handles(aten.slice_copy.Tensor, aten.slice.Tensor)
def slice_(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    rank = len(x.shape)
    dim = node_arg(node, 1, "dim", 0) % rank
    start, end = node_arg(node, 2, "start"), node_arg(node, 3, "end")
    step = node_arg(node, 4, "step", 1)
    start, end = (meta_val(a) if isinstance(a, torch.fx.Node) else a for a in (start, end))
    if not isinstance(step, int) or step < 1:
        raise Unsupported(f"slice step {step}")
    start = 0 if start is None else start
    end = 2**63 - 1 if end is None else end
    if all(_is_static(v) for v in (start, end, *x.shape)):
        size = int(x.shape[dim])
        start = max(0, min(start + size if start < 0 else start, size))
        end = max(start, min(end + size if end < 0 else end, size))
        starts, stops, strides = [0] * rank, [int(d) for d in x.shape], [1] * rank
        starts[dim], stops[dim], strides[dim] = start, end, step
        b.bind(node, b.emit(ir.SliceNode, x.dtype, out.shape, a=x.tid, start=starts, stop=stops, strides=strides))
        return
    # Run-time bounds: the runtime clamps them like Python slices.
    starts, stops, strides = [b.size(0)] * rank, [b.size(d) for d in x.shape], [1] * rank
    starts[dim], stops[dim], strides[dim] = b.size(start), b.size(end), step
    b.bind(node, b.emit(ir.DynSliceNode, x.dtype, out.shape, a=x.tid, start=starts, stop=stops, strides=strides))


@handles(aten.select_copy.int, aten.select.int)
def select(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    dim = node.args[1] % len(x.shape)
    index = node.args[2]
    if isinstance(index, torch.fx.Node):
        index = meta_val(index)
    size = x.shape[dim]
    if _is_static(index) and _is_static(size):
        idx = b.literal(index % size, torch.int32)
    else:
        if _is_static(index) and index < 0:
            index = size + index  # a symbolic size expression
        idx = b.cast(b.sym_value(index), torch.int32)
    b.bind(node, b.emit(ir.TakeNode, x.dtype, out.shape, a=x.tid, indices=idx.tid, axis=dim))


@handles(aten.split_with_sizes_copy.default, aten.split_with_sizes.default, aten.split_copy.Tensor,
         aten.split.Tensor)
def split(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Consecutive slices along `dim`; bound as a list (getitem picks one)."""
    x = b.get(node.args[0])
    rank = len(x.shape)
    dim = node_arg(node, 2, "dim", 0) % rank
    if not _is_static(x.shape[dim]):
        raise Unsupported("split along a dynamic dimension")
    static = all(_is_static(d) for d in x.shape)
    parts, offset = [], 0
    for piece in meta_val(node):
        n = int(piece.shape[dim])
        starts, stops, strides = [0] * rank, list(x.shape), [1] * rank
        starts[dim], stops[dim] = offset, offset + n
        if static:
            part = b.emit(ir.SliceNode, x.dtype, piece.shape, a=x.tid, start=starts, stop=[int(d) for d in stops],
                          strides=strides)
        else:
            part = b.emit(ir.DynSliceNode, x.dtype, piece.shape, a=x.tid, start=b.dims(starts),
                          stop=b.dims(stops), strides=strides)
        parts.append(part)
        offset += n
    b.bind(node, parts)


def _advanced_index(indices) -> tuple[int, torch.fx.Node]:
    """(axis, index tensor) of an index list with exactly one tensor."""
    tensors = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(tensors) != 1:
        raise Unsupported("indexing with more than one index tensor")
    axis, t = tensors[0]
    if meta_val(t).dtype == torch.bool:
        raise Unsupported("boolean mask indexing (data-dependent shape)")
    return axis, t


@handles(aten.index.Tensor)
def index(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x[..., idx, ...] with one integer index tensor: take along its axis;
    with several on adjacent axes of static sizes (x[i, j], a padding mask
    read at [batch, position]), take along those axes flattened into one, at
    the flat index i * size_j + j (indices from 0, as masks index: a
    negative one would wrap into the wrong row)."""
    x = b.get(node.args[0])
    out = meta_val(node)
    tensors = [(i, t) for i, t in enumerate(node.args[1]) if t is not None]
    if len(tensors) == 1:
        axis, t = _advanced_index(node.args[1])
        b.bind(node, b.emit(ir.TakeNode, x.dtype, out.shape, a=x.tid, indices=b.get(t).tid, axis=axis))
        return
    axes = [i for i, _ in tensors]
    sizes = x.shape[axes[0]:axes[-1] + 1]
    if axes != list(range(axes[0], axes[-1] + 1)) or not all(isinstance(d, int) for d in sizes):
        raise Unsupported("indexing with index tensors on axes that are not adjacent or not of static sizes")
    if any(meta_val(t).dtype in (torch.bool, torch.uint8) for _, t in tensors):
        raise Unsupported("boolean mask indexing (data-dependent shape)")
    flat = None
    for k, (_, t) in enumerate(tensors):
        term = b.cast(b.get(t), torch.int64)
        if (stride := math.prod(sizes[k + 1:])) != 1:
            term = b.emit(ir.MultiplyNode, torch.int64, term.shape, a=term.tid, b=b.literal(stride, torch.int64).tid)
        if flat is not None:
            term = b.emit(ir.AddNode, torch.int64, torch.broadcast_shapes(flat.shape, term.shape), a=flat.tid,
                          b=term.tid)
        flat = term
    joined = b.reshape(x, (*x.shape[:axes[0]], math.prod(sizes), *x.shape[axes[-1] + 1:]))
    b.bind(node, b.emit(ir.TakeNode, x.dtype, out.shape, a=joined.tid, indices=flat.tid, axis=axes[0]))


@handles(aten.index_select.default)
def index_select(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x.index_select(dim, idx): the entries idx [K] along dim (XGLM's sinusoidal positions)."""
    x = b.get(node.args[0])
    out = meta_val(node)
    b.bind(node, b.emit(ir.TakeNode, x.dtype, out.shape, a=x.tid, indices=b.get(node.args[2]).tid,
                        axis=node.args[1] % len(x.shape)))


@handles(aten.index_put.default, aten.index_put_.default)
def index_put(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x[..., idx, ...] = values (integer index tensors, no accumulate): a
    scatter along their axes, in place when x is a mutable buffer (KV cache
    writes at cache_position; with several, x[row, :, slot] = values writes
    each row of a batch at its own slots)."""
    if node_arg(node, 3, "accumulate", False):
        raise Unsupported("index_put with accumulate=True")
    tensors = [(i, t) for i, t in enumerate(node.args[1]) if t is not None]
    if len(tensors) > 1:
        _scatter_many(b, node, b.get(node.args[0]), tensors, b.get(node.args[2]))
        return
    axis, t = _advanced_index(node.args[1])
    _scatter(b, node, b.get(node.args[0]), axis, b.get(t), b.get(node.args[2]))


@handles(aten.index_copy.default, aten.index_copy_.default)
def index_copy(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x.index_copy(dim, idx, source): the same write as x[..., idx, ...] = source."""
    x = b.get(node.args[0])
    idx = b.get(node.args[2])
    if len(idx.shape) != 1:
        raise Unsupported("index_copy with a multi-dimensional index")
    _scatter(b, node, x, node.args[1] % len(x.shape), idx, b.get(node.args[3]))


@handles(aten.slice_scatter.default)
def slice_scatter(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x with x[start:end:step] along dim replaced by src (static bounds)."""
    x, src = b.get(node.args[0]), b.get(node.args[1])
    rank = len(x.shape)
    dim = node_arg(node, 2, "dim", 0) % rank
    start, end, step = node_arg(node, 3, "start"), node_arg(node, 4, "end"), node_arg(node, 5, "step", 1)
    if not all(_is_static(v) for v in (start, end, step, x.shape[dim])) or any(isinstance(v, torch.fx.Node)
                                                                                for v in (start, end)):
        raise Unsupported("slice_scatter with dynamic bounds")
    size = int(x.shape[dim])
    start = 0 if start is None else max(0, min(start + size if start < 0 else start, size))
    end = size if end is None else max(start, min(end + size if end < 0 else end, size))
    if not all(_is_static(v) for v in x.shape):  # other axes dynamic: a scatter at the slice's (static) indices
        idx = b.emit(ir.ArangeNode, torch.int64, (len(range(start, end, step)),), start=float(start),
                     stop=float(end), step=float(step), dtype=ir.DType.int64)
        _scatter(b, node, x, dim, idx, src)
        return
    starts, stops, strides = [0] * rank, [int(d) for d in x.shape], [1] * rank
    starts[dim], stops[dim], strides[dim] = start, end, step
    src = b.cast(src, x.dtype)
    b.bind(node, b.emit(ir.SliceUpdateNode, x.dtype, meta_val(node).shape, a=x.tid, update=src.tid, start=starts,
                        stop=stops, strides=strides))


def _scatter(b: GraphBuilder, node: torch.fx.Node, x, axis: int, idx, values) -> None:
    """x with x[..., idx, ...] (idx along `axis`) set to `values`."""
    values = b.cast(values, x.dtype)
    # values broadcast to x[..., idx, ...]'s shape: x.shape[:axis] + idx.shape + x.shape[axis+1:]
    k = len(idx.shape)
    target = tuple(x.shape[:axis]) + tuple(idx.shape) + tuple(x.shape[axis + 1:])
    if tuple(map(str, values.shape)) != tuple(map(str, target)):
        values = b.emit(ir.BroadcastToNode, x.dtype, target, a=values.tid, shape=b.dims(target))
    # MLX's scatter wants updates shaped idx.shape + slice, the slice being x
    # with size 1 along the axis: move the index dims first, then insert it.
    perm = list(range(axis, axis + k)) + list(range(axis)) + list(range(axis + k, len(target)))
    if perm != list(range(len(target))):
        values = b.emit(ir.TransposeNode, x.dtype, tuple(target[p] for p in perm), a=values.tid, axes=perm)
    shape = tuple(values.shape[:k]) + tuple(x.shape[:axis]) + (1,) + tuple(x.shape[axis + 1:])
    values = b.emit(ir.ExpandDimsNode, x.dtype, shape, a=values.tid, axes=[k + axis])
    out = meta_val(node)
    b.bind(node, b.emit(ir.ScatterNode, x.dtype, out.shape, a=x.tid, indices=[idx.tid], updates=values.tid,
                        axes=[axis]))


def _scatter_many(b: GraphBuilder, node: torch.fx.Node, x, tensors: list, values) -> None:
    """x[i0, ..., ik] = values for index tensors on several axes (torch's
    advanced indexing: the indices broadcast to one shape I; the indexed
    shape is I in place of adjacent axes, or I first when they are apart)."""
    if any(meta_val(t).dtype == torch.bool for _, t in tensors):
        raise Unsupported("boolean mask indexing (data-dependent shape)")
    axes = [axis for axis, _ in tensors]
    shape = _broadcast_shape([tuple(meta_val(t).shape) for _, t in tensors])
    indices = []
    for _, t in tensors:
        idx = b.get(t)
        if tuple(map(str, idx.shape)) != tuple(map(str, shape)):
            idx = b.emit(ir.BroadcastToNode, idx.dtype, shape, a=idx.tid, shape=b.dims(shape))
        indices.append(idx)
    values = b.cast(values, x.dtype)
    rest = [d for d in range(len(x.shape)) if d not in axes]
    adjacent = axes == list(range(axes[0], axes[0] + len(axes)))
    before = [d for d in rest if d < axes[0]] if adjacent else []
    target = tuple(x.shape[d] for d in before) + shape + tuple(x.shape[d] for d in rest if d not in before)
    if tuple(map(str, values.shape)) != tuple(map(str, target)):
        values = b.emit(ir.BroadcastToNode, x.dtype, target, a=values.tid, shape=b.dims(target))
    k, lead = len(shape), len(before)
    # MLX's scatter wants updates shaped I + x's shape with 1 on each indexed axis
    perm = list(range(lead, lead + k)) + list(range(lead)) + list(range(lead + k, len(target)))
    if perm != list(range(len(target))):
        values = b.emit(ir.TransposeNode, x.dtype, tuple(target[p] for p in perm), a=values.tid, axes=perm)
    slice_shape = tuple(1 if d in axes else x.shape[d] for d in range(len(x.shape)))
    values = b.emit(ir.ExpandDimsNode, x.dtype, shape + slice_shape, a=values.tid, axes=[k + a for a in axes])
    b.bind(node, b.emit(ir.ScatterNode, x.dtype, meta_val(node).shape, a=x.tid, indices=[i.tid for i in indices],
                        updates=values.tid, axes=axes))


def _broadcast_shape(shapes: list[tuple]) -> tuple:
    """The shape `shapes` broadcast to (sizes may be symbolic: a size of 1
    gives way to the other; two others must be the same size)."""
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        sizes = [s[d - rank + len(s)] for s in shapes if d - rank + len(s) >= 0]
        wide = [n for n in sizes if not (_is_static(n) and int(n) == 1)]
        if any(not same_size(n, wide[0]) for n in wide):
            raise Unsupported(f"index tensors of shapes {shapes} do not broadcast")
        out.append(wide[0] if wide else 1)
    return tuple(out)


@handles(aten.gather.default)
def gather(b: GraphBuilder, node: torch.fx.Node) -> None:
    """torch.gather(x, dim, index): take along `dim`; x is first cut to the
    index's size on the other axes (torch lets the index be smaller there)."""
    x, idx = b.get(node.args[0]), b.get(node.args[2])
    rank = len(x.shape)
    if rank == 0 or len(idx.shape) != rank:
        raise Unsupported("gather of a 0-d tensor or with an index of another rank")
    dim = node.args[1] % rank
    cut = [d for d in range(rank) if d != dim and not same_size(x.shape[d], idx.shape[d])]
    if cut:
        if not all(_is_static(v) for v in (*x.shape, *idx.shape)):
            raise Unsupported("gather with a smaller index along a dynamic axis")
        stops = [int(x.shape[d]) if d == dim else int(idx.shape[d]) for d in range(rank)]
        x = b.emit(ir.SliceNode, x.dtype, tuple(stops), a=x.tid, start=[0] * rank, stop=stops, strides=[1] * rank)
    out = meta_val(node)
    b.bind(node, b.emit(ir.TakeAlongAxisNode, x.dtype, out.shape, a=x.tid, indices=idx.tid, axis=dim))


@handles(aten.scatter.value)
def scatter_value(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x.scatter(dim, index, value) along the last axis (routers' masks: a
    value at each row's k indices), as where(any_k(index == column), value, x);
    the index shaped as x but for that axis."""
    x, idx, value = b.get(node.args[0]), b.get(node.args[2]), node.args[3]
    rank = len(x.shape)
    if rank == 0 or len(idx.shape) != rank or node.args[1] % rank != rank - 1:
        raise Unsupported("scatter of a value other than along the last axis")
    if not all(same_size(x.shape[d], idx.shape[d]) for d in range(rank - 1)) or not _is_static(x.shape[-1]):
        raise Unsupported("scatter with an index smaller than the tensor, or a dynamic last axis")
    if isinstance(value, torch.fx.Node):
        raise Unsupported("scatter of a dynamic value")
    columns = b.emit(ir.ArangeNode, idx.dtype, (x.shape[-1],), start=0.0, stop=float(x.shape[-1]), step=1.0,
                     dtype=ir_dtype(idx.dtype))
    per_k = tuple(idx.shape) + (x.shape[-1],)
    wide = b.emit(ir.ExpandDimsNode, idx.dtype, tuple(idx.shape) + (1,), a=idx.tid, axes=[rank])
    hit = b.emit(ir.EqualNode, torch.bool, per_k, a=wide.tid, b=columns.tid)
    hit = b.emit(ir.AnyNode, torch.bool, tuple(x.shape), a=hit.tid, axes=[rank - 1], keepdims=False)
    b.bind(node, b.emit(ir.WhereNode, x.dtype, tuple(x.shape), condition=hit.tid, x=b.literal(value, x.dtype).tid,
                        y=x.tid))


@handles(aten.cat.default)
def cat(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    # torch skips 1-d empty tensors in cat; promote the rest to the out dtype
    parts = [b.cast(b.get(a), out.dtype) for a in node.args[0] if tuple(meta_val(a).shape) != (0,)]
    dim = node_arg(node, 1, "dim", 0)
    dim %= len(out.shape)
    if len(parts) == 1:
        b.bind(node, parts[0])
        return
    b.bind(node, b.emit(ir.ConcatenateNode, out.dtype, out.shape, inputs=[p.tid for p in parts], axis=dim))


@handles(aten.embedding.default)
def embedding(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Rows of `weight`. An out-of-range id (torch raises IndexError) gives a
    NaN row for float weights: visible downstream (a SamplingHead returns -1)
    without a host synchronisation. The runtime never reads out of bounds."""
    out = meta_val(node)
    weight, ids = b.get(node.args[0]), b.get(node.args[1])
    rows = b.emit(ir.TakeNode, weight.dtype, out.shape, a=weight.tid, indices=ids.tid, axis=0)
    if not weight.dtype.is_floating_point:
        b.bind(node, rows)
        return
    lo = b.emit(ir.GreaterEqualNode, torch.bool, ids.shape, a=ids.tid, b=b.literal(0, ids.dtype).tid)
    hi = b.emit(ir.LessNode, torch.bool, ids.shape, a=ids.tid, b=b.literal(weight.shape[0], ids.dtype).tid)
    valid = b.emit(ir.LogicalAndNode, torch.bool, ids.shape, a=lo.tid, b=hi.tid)
    valid = b.emit(ir.ExpandDimsNode, torch.bool, (*ids.shape, 1), a=valid.tid, axes=[len(ids.shape)])
    nan = b.literal(float("nan"), weight.dtype)
    b.bind(node, b.emit(ir.WhereNode, weight.dtype, out.shape, condition=valid.tid, x=rows.tid, y=nan.tid))


@handles(aten.clone.default, aten.alias_copy.default, aten.alias.default, aten.detach_copy.default,
         aten.lift_fresh_copy.default)
def identity(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.bind(node, b.get(node.args[0]))
