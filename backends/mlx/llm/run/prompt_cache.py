"""Earlier conversations' caches, kept for their next turns (a prompt cache
across conversations: `serve --prompt-cache-bytes`).

One program has one KV cache, and a runner reuses the common prefix of a
request with what it holds. A request that would keep less than half of
that (another conversation) first has the state snapshotted, keyed by the
tokens it holds (`snapshot_state`: by reference, so the next update copies
what it changes); a request that shares more with a kept snapshot than with
the live cache has that snapshot restored before it runs. Snapshots are
dropped least recently used first to stay within `max_bytes` (each holds
the whole state of the loaded programs, the KV caches and any draft model's).

A batched program's rows (llm/run/batch.py) keep theirs with `KeptRows`: a
row about to take another conversation is copied first
(`snapshot_state_row`: that row of each cache, not the whole state) and
kept with its tokens, and a request that shares more with a kept row than
with any free live row has it copied into the row it runs in
(`copy_state_row`), the other rows as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Kept:
    tokens: list[int]
    bytes: int


def check_bytes(max_bytes) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"the prompt cache's size must be a number of bytes >= 0, got {max_bytes!r}")
    return max_bytes


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = check_bytes(max_bytes)
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # by snapshot id, least recently used first

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def prepare(self, runner, ids: list[int]) -> None:
        """Before `ids` run on `runner`: keep what its cache holds if they
        would overwrite most of it; bring back a kept cache that shares more
        of them than the live one does."""
        from executorch_mlx._runtime_library import restore_state

        held = runner.cached_tokens
        live = runner.reusable(ids, held)
        gains = {s: runner.reusable(ids, k.tokens) for s, k in self._kept.items()}
        best = max(gains, key=gains.get, default=None)
        if best is not None and gains[best] <= live:
            best = None
        if held and live < len(held) // 2:
            self._keep(held, best)
        if best is not None:
            restore_state(best)
            runner.cached_tokens = list(self._kept[best].tokens)
            self._kept.move_to_end(best)

    def _keep(self, tokens: list[int], resumed: int | None) -> None:
        """Snapshots the state holding `tokens`, then drops the least
        recently used snapshots past max_bytes, never `resumed` (the one
        about to be restored)."""
        from executorch_mlx._runtime_library import drop_state, snapshot_state

        for snapshot in [s for s, k in self._kept.items() if tokens[:len(k.tokens)] == k.tokens and s != resumed]:
            drop_state(snapshot)  # an earlier point of the same conversation
            del self._kept[snapshot]
        snapshot, size = snapshot_state()
        self._kept[snapshot] = _Kept(list(tokens), size)
        while self.bytes > self.max_bytes:
            oldest = next((s for s in self._kept if s != resumed), None)
            if oldest is None:  # (only the resumed one is left)
                break
            drop_state(oldest)
            del self._kept[oldest]

    def clear(self) -> None:
        from executorch_mlx._runtime_library import drop_state

        for snapshot in self._kept:
            drop_state(snapshot)
        self._kept.clear()


@dataclass
class _KeptRow:
    tokens: list[int]
    bytes: int


class KeptRows:
    """Conversations of a batched program's cache rows, kept in snapshots
    for their next turns, least recently used dropped first past `max_bytes`."""

    def __init__(self, max_bytes: int, rows: int):
        self.max_bytes, self.rows = check_bytes(max_bytes), rows
        self._kept: OrderedDict[int, _KeptRow] = OrderedDict()  # by snapshot id, least recently used first

    def __len__(self) -> int:
        return len(self._kept)

    def best(self, ids: list[int], reusable) -> tuple[int | None, int]:
        """The kept snapshot sharing the most with `ids` (reusable(ids, tokens)
        tokens) and that count; (None, 0) for none."""
        gains = {s: reusable(ids, k.tokens) for s, k in self._kept.items()}
        best = max(gains, key=gains.get, default=None)
        return (best, gains[best]) if best is not None else (None, 0)

    def keep(self, tokens: list[int], row: int) -> int | None:
        """Copies row `row`, which holds `tokens`, into a snapshot (an earlier
        point of their conversation is dropped); the snapshot's id, or None
        when it is not kept (max_bytes 0, or less than a row)."""
        from executorch_mlx._runtime_library import drop_state, snapshot_state_row

        if not self.max_bytes:
            return None
        for snapshot in [s for s, k in self._kept.items() if tokens[:len(k.tokens)] == k.tokens]:
            drop_state(snapshot)
            del self._kept[snapshot]
        snapshot, size = snapshot_state_row(row, self.rows)
        self._kept[snapshot] = _KeptRow(list(tokens), size)
        while self._kept and sum(k.bytes for k in self._kept.values()) > self.max_bytes:
            oldest = next(iter(self._kept))
            drop_state(oldest)
            del self._kept[oldest]
        return snapshot if snapshot in self._kept else None

    def restore(self, snapshot: int, row: int) -> list[int]:
        """Copies the kept row `snapshot` into live row `row`; its tokens."""
        from executorch_mlx._runtime_library import copy_state_row

        kept = self._kept[snapshot]
        copy_state_row(snapshot, row, self.rows)
        self._kept.move_to_end(snapshot)
        return list(kept.tokens)

    def clear(self) -> None:
        from executorch_mlx._runtime_library import drop_state

        for snapshot in self._kept:
            drop_state(snapshot)
        self._kept.clear()
