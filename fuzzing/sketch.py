"""Hand-built IR graphs, and a way to run any graph through ExecuTorch.

`Sketch` writes a graph node by node over three fixed inputs (x, y: float32
[2, 3, 4]; i: int64 [2, 3]). `wrap(graph)` turns it into a .pte by
swapping it into a template program whose delegate has exactly those inputs
and one float32 scalar output, so a graph of any size runs through the real
path (ExecuTorch's loader, our backend's init and execute) without
torch.export per graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from executorch_mlx.serialization import ir

F32, F16, I64, U32, BOOL = ir.DType.float32, ir.DType.float16, ir.DType.int64, ir.DType.uint32, ir.DType.bool_
INPUTS = (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)),
          torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)),
          torch.tensor([[0, 1, 2], [2, 1, 0]]))
# A wrapped blob is padded to this size (trailing bytes are ignored by the
# FlatBuffers verifier), so every graph fits the template's blob in place.
BLOB_SIZE = 1 << 16


def _static(shape) -> list[ir.Dim]:
    return [ir.Dim(size=s, symbol=-1) for s in shape]


class Sketch:
    """A graph under construction over the inputs x, y, i (slots 0, 1, 2)."""

    def __init__(self, dynamic_batch: bool = False):
        x_shape = _static((2, 3, 4))
        symbols = []
        if dynamic_batch:  # x's first dimension is the symbol "b" in [1, 4]
            symbols = [ir.Symbol(name="b", min=1, max=4)]
            x_shape[0] = ir.Dim(size=0, symbol=0)
        self.graph = ir.Graph(num_values=3, symbols=symbols, inputs=[
            ir.IOValue(slot=0, dtype=F32, shape=x_shape),
            ir.IOValue(slot=1, dtype=F32, shape=_static((2, 3, 4))),
            ir.IOValue(slot=2, dtype=I64, shape=_static((2, 3))),
        ])
        self.x, self.y, self.i = ir.Tid(0), ir.Tid(1), ir.Tid(2)

    def new(self) -> ir.Tid:
        self.graph.num_values += 1
        return ir.Tid(self.graph.num_values - 1)

    def lit(self, value, dtype: ir.DType = F32) -> ir.Tid:
        t = self.new()
        if dtype in (F32, F16, ir.DType.bfloat16):
            self.graph.literals.append(ir.Literal(slot=t.idx, dtype=dtype, float_value=float(value)))
        else:
            self.graph.literals.append(ir.Literal(slot=t.idx, dtype=dtype, int_value=int(value)))
        return t

    def op(self, cls, **fields) -> ir.Tid:
        out = self.new()
        self.graph.nodes.append(ir.Node(op=cls(**fields, out=out)))
        return out

    def full(self, shape, value, dtype: ir.DType = F32) -> ir.Tid:
        lit_dtype = dtype if dtype != U32 else I64
        return self.op(ir.FullNode, shape=sizes(*shape), value=self.lit(value, lit_dtype), dtype=dtype)

    def state(self, shape, dtype: ir.DType = F32) -> ir.Tid:
        """A zero-initialised mutable buffer; bind its update with `update`."""
        t = self.new()
        self.graph.mutable_buffers.append(ir.MutableBuffer(slot=t.idx, update=t.idx, initial="", dtype=dtype,
                                                           shape=list(shape), zero_initial=True))
        return t

    def update(self, buffer: ir.Tid, value: ir.Tid) -> None:
        next(b for b in self.graph.mutable_buffers if b.slot == buffer.idx).update = value.idx

    def finish(self, out: ir.Tid, rank: int) -> ir.Graph:
        """Reduces `out` (of rank `rank`) to the template's float32 scalar."""
        f = self.op(ir.AsTypeNode, a=out, dtype=F32)
        s = self.op(ir.SumNode, a=f, axes=list(range(rank))) if rank else f
        self.graph.outputs = [ir.IOValue(slot=s.idx, dtype=F32, shape=[])]
        return self.graph


def sizes(*values: int) -> list[ir.IntOrSlot]:
    return [ir.IntOrSlot(value=v, slot=-1) for v in values]


@dataclass(frozen=True)
class Template:
    """A .pte whose delegate blob is `placeholder`, and the inputs it takes."""

    pte: bytes
    placeholder: bytes
    inputs: tuple

    def with_blob(self, blob: bytes) -> bytes:
        if len(blob) != len(self.placeholder):
            raise ValueError(f"blob of {len(blob)} bytes does not replace one of {len(self.placeholder)}")
        return self.pte.replace(self.placeholder, blob)


def pad(blob: bytes) -> bytes:
    if len(blob) > BLOB_SIZE:
        raise ValueError(f"graph blob of {len(blob)} bytes exceeds {BLOB_SIZE}")
    return blob + bytes(BLOB_SIZE - len(blob))


def capture_blob(lower, pad_to_template: bool = False) -> tuple[bytes, bytes]:
    """Runs `lower()` (which must produce one delegate) and returns its .pte
    and the delegate's blob as it lies in the .pte."""
    from executorch_mlx.backend import rewrite_blobs

    blobs = []

    def keep(graph, blob):
        blob = pad(blob) if pad_to_template else blob
        blobs.append(blob)
        return blob

    with rewrite_blobs(keep):
        pte = lower()
    if len(blobs) != 1 or pte.count(blobs[0]) != 1:
        raise RuntimeError(f"expected one delegate blob in the program, found {len(blobs)}")
    return pte, blobs[0]


class _TemplateModel(torch.nn.Module):
    def forward(self, x, y, i):
        return (x * y).sum() + i.sum().to(torch.float32)


@functools.cache
def sketch_template() -> Template:
    """The program every Sketch graph is wrapped into."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx.partitioner import MLXPartitioner

    def lower():
        ep = torch.export.export(_TemplateModel(), INPUTS)
        return to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch().buffer

    pte, blob = capture_blob(lower, pad_to_template=True)
    return Template(pte, blob, INPUTS)


def wrap(graph: ir.Graph) -> bytes:
    """A .pte that runs `graph` (inputs and output as Sketch makes them)."""
    return sketch_template().with_blob(pad(ir.serialize(graph)))
