"""The sampler's filter cases, an independent float64 oracle of docs/sampling.md,
and the draws of one lowered program over them.

`python sampler_cases.py OUT [PROGRAMS]` writes the draws of every case to
OUT (a torch file): the test runs that in a subprocess with
EMLX_DISABLE_CPU_KERNELS=1 to hold the MLX-ops path to the same contract as
the native kernel. PROGRAMS, a folder of the programs the test process
exported (write_programs), saves the subprocess importing the export stack
and exporting the same bytes again (~15 s): the runtime alone runs them.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

INF = float("inf")
# V = 12 hand-made logits with ties (1.5, 1.5 and 0.7, 0.7) and a masked token.
LOGITS = [2.0, 1.5, 1.5, 1.0, 0.7, 0.7, 0.3, 0.0, -0.5, -1.0, -INF, 1.2]
VOCAB = len(LOGITS)
HISTORY = [0, 3, 3, 7, 11, -1]  # token 3 twice; -1 pads
ROWS, CALLS = 2000, 50  # 100k draws per case, each from its own (seed, position)

# case -> (parameters of even rows, parameters of odd rows): the rows of one
# batch differ in every case. Values sit away from knife edges (checked by
# `oracle(..., margin=True)`).
_PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
_BIAS = {5: 0.9, 1: -INF, 8: 2.0}
CASES = {
    "top_k": (dict(temperature=1.0, top_k=2), dict(temperature=0.7, top_k=5)),
    "top_p": (dict(temperature=1.0, top_p=0.6), dict(temperature=1.5, top_p=0.85)),
    "min_p": (dict(temperature=1.0, min_p=0.2), dict(temperature=0.6, min_p=0.05)),
    "top_k+top_p": (dict(temperature=1.0, top_k=5, top_p=0.7), dict(temperature=2.0, top_k=3, top_p=0.9)),
    "top_k+min_p": (dict(temperature=1.0, top_k=6, min_p=0.3), dict(temperature=1.2, top_k=4, min_p=0.1)),
    "top_p+min_p": (dict(temperature=1.0, top_p=0.8, min_p=0.15), dict(temperature=0.8, top_p=0.95, min_p=0.3)),
    "all three": (dict(temperature=1.0, top_k=6, top_p=0.8, min_p=0.1),
                  dict(temperature=1.4, top_k=8, top_p=0.7, min_p=0.05)),
    "all three+penalties+bias": (dict(temperature=1.0, top_k=6, top_p=0.85, min_p=0.1, **_PENALTIES, bias=_BIAS),
                                 dict(temperature=0.9, top_k=7, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                                      frequency_penalty=0.5, presence_penalty=0.3, bias={2: 1.0})),
    # a token mask (the allowed ids): applied after the bias, before every filter
    "mask": (dict(temperature=1.0, mask={0, 2, 4, 5, 9, 11}),
             dict(temperature=0.7, top_k=3, mask={1, 3, 6, 7, 8, 10})),
    "mask+all three+penalties+bias": (
        dict(temperature=1.0, top_k=6, top_p=0.85, min_p=0.1, **_PENALTIES, bias=_BIAS, mask={0, 1, 2, 3, 5, 6, 8, 11}),
        dict(temperature=0.9, top_k=4, top_p=0.9, min_p=0.02, repetition_penalty=1.1, frequency_penalty=0.5,
             presence_penalty=0.3, bias={2: 1.0}, mask={2, 3, 4, 5, 7, 9, 11})),
}
BIAS_SLOTS = 3


def penalized(logits: list[float], history=(), repetition_penalty=1.0, frequency_penalty=0.0,
              presence_penalty=0.0, bias=None, mask=None) -> list[float]:
    """docs/sampling.md step 1 in float64, one token at a time (`mask`: the
    allowed ids, None for all)."""
    x = [-INF if math.isnan(v) else v for v in logits]
    counts = {}
    for t in history:
        if 0 <= t < len(x):
            counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        v = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
        x[t] = v - frequency_penalty * c - presence_penalty
    for t, v in (bias or {}).items():
        x[t] = -INF if x[t] == INF and v == -INF else x[t] + v
    if mask is not None:
        x = [v if t in mask else -INF for t, v in enumerate(x)]
    return x


def mask_words(allowed, vocab: int = VOCAB) -> list[int]:
    """The int32 words of a token bitmask allowing `allowed` (None: every bit set)."""
    words = [0] * ((vocab + 31) // 32)
    for t in range(32 * len(words)) if allowed is None else allowed:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def oracle(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, history=(), margin=False,
           **penalties) -> list[float]:
    """The exact distribution of docs/sampling.md, float64, written as the page
    reads (quadratic; V is small). `margin=True` asserts no filter decision
    is within 1e-3 of its threshold (so float32 on the device cannot flip it)."""
    x = penalized(logits, history, **penalties)
    m = max(x)
    z = [(v - m) / temperature if v > -INF else -INF for v in x]
    keep = [v > -INF for v in z]
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z)]
        if margin:
            assert all(abs(v - kth) > 1e-3 or v == kth for v in z)
    if min_p > 0:
        keep = [k and v >= math.log(min_p) for k, v in zip(keep, z)]
        if margin:
            assert all(abs(v - math.log(min_p)) > 1e-3 for v in z if v > -INF)
    if top_p < 1:
        p = [math.exp(v) if k else 0.0 for k, v in zip(keep, z)]
        total = sum(p)
        above = [sum(pj for pj, zj in zip(p, z) if zj > zi) / total for zi in z]
        if margin:
            assert all(abs(a - top_p) > 1e-3 for a, k in zip(above, keep) if k)
        keep = [k and a < top_p for k, a in zip(keep, above)]
    p = [math.exp(v) if k else 0.0 for k, v in zip(keep, z)]
    return [v / sum(p) for v in p]


def program_inputs(params: list[dict], seeds: torch.Tensor, position: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    """Inputs of the all-parameter program (after the logits) for rows with `params`."""
    rows = len(params)

    def col(name, off, dtype=torch.float32):
        return torch.tensor([p.get(name, off) for p in params], dtype=dtype)

    ids = [[-1] * BIAS_SLOTS for _ in range(rows)]
    values = [[0.0] * BIAS_SLOTS for _ in range(rows)]
    for r, p in enumerate(params):
        for j, (t, v) in enumerate((p.get("bias") or {}).items()):
            ids[r][j], values[r][j] = t, v
    words = {}  # a mask's words, computed once per distinct mask (the cases repeat two down the batch)
    for p in params:
        mask = p.get("mask")
        key = None if mask is None else frozenset(mask)
        if key not in words:
            words[key] = mask_words(mask, vocab)
    masks = torch.tensor([words[None if p.get("mask") is None else frozenset(p["mask"])] for p in params],
                         dtype=torch.int32)
    return [col("temperature", 1.0), seeds, torch.full((rows,), position, dtype=torch.int64),
            col("top_k", 0, torch.int64), col("top_p", 1.0), col("min_p", 0.0), col("repetition_penalty", 1.0),
            col("frequency_penalty", 0.0), col("presence_penalty", 0.0),
            torch.tensor([HISTORY] * rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
            torch.tensor(values, dtype=torch.float32), masks]


# (rows, vocab) -> the program's bytes, exported by another process (see the module's docstring)
EXPORTED: dict[tuple[int, int], bytes] = {}
PROGRAM_SIZES = [(ROWS, VOCAB), (64, 1000)]  # those of draws and edge_draws, and of shared_word_draws


def write_programs(folder) -> None:
    """The programs of PROGRAM_SIZES as files `folder`/ROWSxVOCAB.pte."""
    from pathlib import Path

    for rows, vocab in PROGRAM_SIZES:
        (Path(folder) / f"{rows}x{vocab}.pte").write_bytes(all_parameters_pte(rows, vocab))


@functools.cache
def all_parameters_pte(rows: int = ROWS, vocab: int = VOCAB) -> bytes:
    if (rows, vocab) in EXPORTED:
        return EXPORTED[rows, vocab]
    from executorch_mlx.llm.export.sampling import export_sampling_head

    class Logits(torch.nn.Module):
        def forward(self, logits):
            return logits

    return export_sampling_head(
        Logits(), (torch.zeros(rows, vocab),), per_row=True, top_k=True, top_p=True, min_p=True,
        repetition_penalty=True, frequency_penalty=True, presence_penalty=True, history_size=len(HISTORY),
        logit_bias_size=BIAS_SLOTS, token_mask=True).buffer


@functools.cache
def all_parameters_method(rows: int = ROWS, vocab: int = VOCAB):
    """`forward` of all_parameters_pte, loaded once; its Program is kept
    alive with it (a Method does not keep its Program)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(all_parameters_pte(rows, vocab))
    return program, program.load_method("forward")


def reference_tokens(logits: torch.Tensor, params: list[dict], times: int = 1) -> torch.Tensor:
    """torch.ops.mlx.sample (the CPU reference, unseeded) over rows with
    `params`, in one call over the rows `times` over ([times * rows])."""
    inputs = program_inputs(params, torch.zeros(len(params), dtype=torch.int64), 0, logits.shape[1])
    inputs = [t.repeat(times, *[1] * (t.dim() - 1)) for t in inputs]
    logits = logits.repeat(times, 1)
    names = ["temperature", None, None, "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
             "presence_penalty", "history", "logit_bias_ids", "logit_bias_values",
             "token_bitmask"]  # program_inputs' order
    return torch.ops.mlx.sample(logits, **{n: t for n, t in zip(names, inputs) if n})


def calls(method, logits: torch.Tensor, params: list[dict], seeds, n: int) -> torch.Tensor:
    """[n, rows] tokens of n calls of `method` at positions 0..n-1, call c
    with seeds(c); the parameter inputs are built once (only the seeds and
    the position change from call to call)."""
    rows, vocab = logits.shape
    fixed = program_inputs(params, torch.zeros(rows, dtype=torch.int64), 0, vocab)
    out = []
    for c in range(n):
        position = torch.full((rows,), c, dtype=torch.int64)
        out.append(method.execute([logits, fixed[0], seeds(c), position, *fixed[3:]])[0])
    return torch.stack(out)


def draws(case: str) -> torch.Tensor:
    """[CALLS, ROWS] tokens of the lowered program; even rows use the case's
    first parameters, odd rows its second."""
    even, odd = CASES[case]
    params = [even if r % 2 == 0 else odd for r in range(ROWS)]
    return calls(all_parameters_method()[1], torch.tensor([LOGITS] * ROWS), params,
                 lambda c: torch.arange(ROWS, dtype=torch.int64) + 1_000_003 * c, CALLS)


def shared_word_draws() -> torch.Tensor:
    """[10, 64] seeded tokens over V = 1000 with filters on: both paths read
    the same random words, so they agree except where a uniform falls within
    rounding of a CDF step (the native kernel uses 53 bits, MLX ops 24)."""
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(11)) * 2
    params = [dict(temperature=1.0, top_k=200, top_p=0.95, min_p=0.001)] * rows
    return calls(all_parameters_method(rows, vocab)[1], logits, params, lambda c: torch.arange(rows) * 977, 10)


# The two silent wrong results issue #6 found, and token masks that allow no
# finite token, as rows of one batch: (logits, temperature, the tokens that
# may be drawn, the token mask's allowed ids or None).
EDGE_ROWS = [
    # T = +inf makes the finite tokens uniform; -inf / inf is NaN, which an
    # argmax-based draw would take: masked tokens must never be drawn
    ([-INF, 0.0, 3.0, -INF, -1.0, -INF], INF, {1, 2, 4}),
    # logits / T overflows float32 (tiny T; logits near the float32 limit)
    ([1.0, 3.0, 2.0, 3.0 - 1e-6, 0.0, 0.5], 1e-45, {1}),
    ([-3.0e38, 3.0e38, 2.9e38, 3.1e38, 1.0, 0.0], 0.5, {3}),
    # the mask allows only a -inf token, or only bits past the vocabulary: id -1
    ([0.5, 1.0, -INF, 2.0, 0.0, 0.0], 1.0, {-1}, {2}),
    ([0.5, 1.0, 3.0, 2.0, 0.0, 0.0], 0.0, {-1}, set(range(VOCAB, 32))),
    # a +inf token masked out: the draw is among the allowed finite ones
    ([INF, 1.0, 0.0, INF, 0.0, 0.0], 1.0, {1, 2}, {1, 2}),
]


def edge_draws(n: int = 20) -> torch.Tensor:
    """[n, ROWS] tokens for EDGE_ROWS repeated down the batch (padded with -inf)."""
    kinds = [EDGE_ROWS[r % len(EDGE_ROWS)] for r in range(ROWS)]
    logits = torch.tensor([row + [-INF] * (VOCAB - len(row)) for row, *_ in kinds])
    params = [dict(temperature=t, mask=mask[0] if mask else None) for _, t, _, *mask in kinds]
    return calls(all_parameters_method()[1], logits, params, lambda c: torch.arange(ROWS) + 7 * c, n)


def greedy_draws() -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """(logits, tokens, per-row parameters): greedy rows with penalties, bias, ties."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 2
    logits[::7, 4] = logits[::7, 5] = 9.0  # ties: the lowest index wins
    params = [dict(temperature=0.0 if r % 3 else -1.0, top_k=r % 5, top_p=0.5, repetition_penalty=1.0 + r % 4 / 2,
                   frequency_penalty=(r % 3) / 2, presence_penalty=(r % 2) * 0.7,
                   bias={r % VOCAB: 3.0 * ((r % 5) - 2), 7: -INF}) for r in range(ROWS)]
    method = all_parameters_method()[1]
    return logits, method.execute([logits, *program_inputs(params, torch.arange(ROWS), 0)])[0], params


if __name__ == "__main__":
    from pathlib import Path

    import executorch_mlx  # noqa: F401

    if len(sys.argv) > 2:
        for rows, vocab in PROGRAM_SIZES:
            EXPORTED[rows, vocab] = (Path(sys.argv[2]) / f"{rows}x{vocab}.pte").read_bytes()
    out = {case: draws(case) for case in CASES}
    out["shared words"] = shared_word_draws()
    out["edge"] = edge_draws()
    out["greedy"] = greedy_draws()[1]
    torch.save(out, sys.argv[1])
