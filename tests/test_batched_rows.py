"""Issue 38 item 2's foundation: a Hugging Face Llama traced with a batch of
rows, each at its own positions, lowers whole to MLX and gives each row the
logits transformers gives that row alone.

The rows' KV cache is [rows, kv heads, slots, head dim]; a call writes each
row's tokens at that row's slots (index_put on the row and slot axes: one
ScatterNode), masks each row's queries to the slots at or before their
positions (a 4D mask, which transformers takes as it is), and rotates them
by those positions. A row with fewer tokens than the call's length pads with
tokens written at a scratch slot (the last), which no query of that row
attends to before its positions reach it. Export does not build such programs
yet (`--max-batch`): this holds the lowering and the numerics they need.
"""

from __future__ import annotations

import torch
from harness import lower, node_types, undelegated_ops
from transformers.cache_utils import Cache

from executorch.runtime import Runtime
from executorch_mlx.llm.model_folders import write_model_folder

SLOTS = 64
SCRATCH = SLOTS - 1


class RowCache(Cache):
    """transformers' cache interface over the program's per-row buffers."""

    def __init__(self, owner: torch.nn.Module, positions: torch.Tensor):
        self.owner, self.positions, self.layers = owner, positions, []

    def update(self, keys, values, layer_idx, cache_kwargs=None):
        k, v = getattr(self.owner, f"keys_{layer_idx}"), getattr(self.owner, f"values_{layer_idx}")
        rows = torch.arange(keys.shape[0])[:, None]
        k[rows, :, self.positions] = keys.transpose(1, 2)
        v[rows, :, self.positions] = values.transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # (positions are given: transformers does not count them from here)


class RowsLM(torch.nn.Module):
    """(input_ids [rows, S], positions [rows, S]) -> each row's last logits [rows, V]."""

    def __init__(self, model, rows: int):
        super().__init__()
        self.model = model
        cfg = model.config
        shape = (rows, cfg.num_key_value_heads, SLOTS, cfg.hidden_size // cfg.num_attention_heads)
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"keys_{i}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"values_{i}", torch.zeros(shape), persistent=False)

    def forward(self, input_ids, positions):
        mask = torch.arange(SLOTS)[None, None, None, :] <= positions[:, None, :, None]
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         past_key_values=RowCache(self, positions), cache_position=positions[0])
        return out.logits[:, -1, :]


def test_each_row_decodes_at_its_own_position_as_it_would_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_model_folder(tmp_path / "llama", "llama", layers=1, hidden=64, heads=4, kv_heads=2,
                                intermediate=128)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    seq = torch.export.Dim("seq", min=1, max=16)
    example = (torch.randint(3, 200, (2, 4)), torch.arange(4).repeat(2, 1))
    with torch.no_grad():
        edge = lower(RowsLM(model, 2), example, dynamic_shapes={"input_ids": {1: seq}, "positions": {1: seq}})
    assert undelegated_ops(edge) == [] and "ScatterNode" in node_types(edge)
    pte = edge.to_executorch().buffer  # (kept: the loaded program reads it)
    method = Runtime.get().load_program(pte).load_method("forward")

    def alone(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -1]

    torch.manual_seed(0)
    a, b = torch.randint(3, 200, (8,)).tolist(), torch.randint(3, 200, (8,)).tolist()
    calls = [  # (row 0's tokens and positions, row 1's), each call's rows as long as each other
        ((a[:3], [0, 1, 2]), (b[:3], [0, 1, 2])),  # both prefill 3
        ((a[3:5], [3, 4]), ([b[3], 0], [3, SCRATCH])),  # row 0 two more; row 1 one and a pad
        ((a[5:6], [5]), (b[4:5], [4])),  # one token each, at different positions
        ((a[6:7], [6]), (b[5:6], [5])),
    ]
    seen = [[], []]
    for call in calls:
        ids = torch.tensor([tokens for tokens, _ in call])
        positions = torch.tensor([slots for _, slots in call])
        out = method.execute([ids, positions])[0]
        for row, (tokens, slots) in enumerate(call):
            real = [t for t, s in zip(tokens, slots) if s != SCRATCH]
            seen[row] += real
            if slots[-1] != SCRATCH:  # (a row whose last query is a pad returns nothing to compare)
                torch.testing.assert_close(out[row], alone(seen[row]), atol=1e-4, rtol=1e-4)
    assert seen == [a[:7], b[:6]]
