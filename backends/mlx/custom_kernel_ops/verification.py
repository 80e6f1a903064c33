"""`mlx::accepted_prefix`: the tokens a speculative verify call emits.

    torch.ops.mlx.accepted_prefix(sampled[R] int64, fed[1, S]) -> [R] int64

`fed`'s last R entries are the token x and the drafts d_1 .. d_{R-1} the call
fed; row i of `sampled` was sampled after x, d_1 .. d_i. The result is
sampled[0 .. a], then -1, where a is the number of leading drafts equal to
the token sampled before them (docs/sampling.md, "Speculative
verification"). One op, so that the lowering makes it one node
(AcceptedPrefixNode) where its composition is a dozen.
"""

from __future__ import annotations

import torch

torch.library.define("mlx::accepted_prefix", "(Tensor sampled, Tensor fed) -> Tensor")


@torch.library.impl("mlx::accepted_prefix", "CompositeExplicitAutograd")
def accepted_prefix(sampled: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    rows = sampled.shape[0]
    drafts = fed[0, fed.shape[1] - rows:]  # x, d_1 .. d_{R-1}
    i = torch.arange(rows)
    following = drafts[torch.clamp(i + 1, max=rows - 1)]  # d_{i+1}; the last row has none
    match = (sampled == following) & (i < rows - 1)
    accepted = torch.argmin(match.to(torch.int32))  # the first mismatch (lowest index; the last row is one)
    return torch.where(i <= accepted, sampled, -1)


@torch.library.register_fake("mlx::accepted_prefix")
def _fake(sampled, fed):
    return sampled.new_empty(sampled.shape)
