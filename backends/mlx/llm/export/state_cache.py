"""State layers (linear attention / gated delta, Mamba-2, short convolutions) in an exported program.

A state layer keeps a fixed-size state instead of keys and values: the last
K - 1 inputs of its causal convolution and/or a recurrent matrix per head.
Export finds them from the model itself: one token through transformers'
own cache gives every layer that holds such states, with their shapes and
dtypes (no family list).

Snapshots, not one state: a runner may start a call before the end of what
it wrote (rejected draft tokens, a prompt that shares a prefix), and a state
cannot be rewound. Each state layer keeps the states after the last N
positions it ran, in a ring of N slots (position p in slot p % N), as
buffers of the program:

- a call starting at position p reads the state after p - 1 (slot
  (p - 1) % N), or zeros at p = 0;
- a call of L tokens ending at `last` writes the states after its last
  min(L, N) positions (slot s gets the newest position q <= last with
  q % N = s, when q is in the call) and keeps the others.

So a call may start anywhere from `last` - N + 2 to `last` + 1: the program
contract says N - 1 (`CACHE_REWIND`), and N = the drafts a call verifies + 1,
so that every verify call can keep any accepted prefix.

The model's own layer code runs unchanged, with transformers' cache methods
answered here and its kernels (the causal convolution, the gated delta rule
and Kimi's delta attention, Mamba-2's chunked scan, Mamba-1's selective scan)
swapped for ours while the program is traced: the convolution is K shifted
products, the recurrences are the `mlx::gated_delta`, `mlx::ssd_scan` and
`mlx::selective_scan` ops
(custom_kernel_ops/state.py), which also return the states after the
call's last min(L, N) positions.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ...custom_kernel_ops.state import kept_states  # (the module defines the ops)
from .module_globals import swapped

# The kernels of transformers' modeling modules that read or write state, by their global name there.
KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan",
           "mamba_selective_scan")


def one_token_cache(model):
    """transformers' own cache after one token through the model: what each
    layer keeps, as the family's code writes it. On fake tensors (shapes
    only, no weight read: export keeps weights in files, llm/export/streamed_load.py)
    when the family's code allows it, else on the weights."""
    ids = torch.zeros(1, 1, dtype=torch.int64)
    try:
        with torch.no_grad():
            out = _fake_forward(model, ids)
            if out is None:
                out = model(input_ids=ids, use_cache=True)
    except Exception as e:  # the family's own code on its own config: named, not a raw traceback
        raise ValueError(f"transformers' own {type(model).__name__} fails on one token with this config "
                         f"({type(e).__name__}: {e}); export needs it to find what each layer caches") from e
    return getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)  # (Mamba's name)


def _fake_forward(model, ids):
    """The model's output on fake tensors; None where its code reads values
    (data-dependent shapes: the experts a token hits) or keeps a tensor it
    computed (then the module state is put back as it was)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    before = {id(m): dict(vars(m)) for m in model.modules()}
    tensors = {id(m): (dict(m._parameters), dict(m._buffers)) for m in model.modules()}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = model(input_ids=ids, use_cache=True)
    except Exception:
        out = None
    for m in model.modules():
        kept = [v for d in (vars(m), m._parameters, m._buffers) for v in d.values() if isinstance(v, FakeTensor)]
        if kept:
            out = None
    if out is None:
        for m in model.modules():
            vars(m).clear()
            vars(m).update(before[id(m)])
            m._parameters, m._buffers = (dict(d) for d in tensors[id(m)])
    return out


def probe_states(cache) -> dict[int, dict]:
    """{layer index: the layer's states} in transformers' own cache after one
    token (one_token_cache): "conv" ([B, C, width] and the kernel size)
    and "recurrent" (shape, dtype), each present only if the layer has it,
    and "attends" when the layer also keeps keys and values (a hybrid layer,
    as Falcon-H1's: attention and Mamba-2 side by side)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    states = {}
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        if layer.number_of_states != 1:
            raise NotImplementedError(f"layer {i} keeps {layer.number_of_states} sets of states (export builds one "
                                      "convolution and one recurrent state a layer)")
        found = {"attends": True} if isinstance(layer, CacheLayerMixin) else {}
        conv = layer.conv_states[0]
        if conv is not None:
            found["conv"] = (tuple(conv.shape[:-1]), conv.dtype, int(layer.conv_kernel_size[0]))
        recurrent = layer.recurrent_states[0]
        if recurrent is not None:
            found["recurrent"] = (tuple(recurrent.shape), recurrent.dtype)
        states[i] = found
    return states


def read_ring(ring: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The state after position start - 1 (zeros at start 0)."""
    state = ring[torch.remainder(start - 1, ring.shape[0]).reshape(1)][0]
    return torch.where(start > 0, state, torch.zeros_like(state))


def write_ring(ring: torch.Tensor, snapshots: torch.Tensor, start: torch.Tensor, length) -> None:
    """Writes into `ring` the states of a call of `length` positions from
    `start`: `snapshots` [m, ...] holds the states after its last m positions
    (oldest first), each to its position's slot; the other slots keep theirs
    (a decode step writes one state)."""
    m = snapshots.shape[0]
    slots = torch.remainder(start + length - m + torch.arange(m), ring.shape[0])
    ring.index_copy_(0, slots, snapshots.to(ring.dtype))


class StateLayers:
    """The state layers of one model, their rings registered as buffers of
    `owner` (`conv_state_{i}`, `recurrent_state_{i}`); what transformers'
    cache methods and the swapped kernels need while a call runs."""

    def __init__(self, owner: torch.nn.Module, states: dict[int, dict], snapshots: int):
        self.owner, self.states, self.snapshots = owner, states, snapshots
        self.active: int | None = None  # the state layer whose code is running
        self.head = 0  # the head its next scan covers, in a layer that scans one at a time (Zamba's)
        self.start = self.length = None
        for i, found in states.items():
            if "conv" in found:
                shape, dtype, kernel = found["conv"]
                owner.register_buffer(f"conv_state_{i}", torch.zeros(snapshots, *shape, kernel - 1, dtype=dtype),
                                      persistent=False)
            if "recurrent" in found:
                shape, dtype = found["recurrent"]
                owner.register_buffer(f"recurrent_state_{i}", torch.zeros(snapshots, *shape, dtype=dtype),
                                      persistent=False)

    def keeps_keys(self, i: int) -> bool:
        """Whether layer i keeps keys and values (attention, or a hybrid layer)."""
        return i not in self.states or self.states[i].get("attends", False)

    def ring(self, kind: str, i: int) -> torch.Tensor:
        # through the module: the buffers export traces (as CachedLM's KV tensors)
        return getattr(self.owner, f"{kind}_state_{i}")

    def begin(self, cache_position: torch.Tensor, length) -> None:
        self.start, self.length = cache_position[0], length

    # --- transformers' cache methods for state layers ---
    def conv_inputs(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """x [B, C, L] after the K - 1 inputs before it; writes the ring."""
        ring = self.ring("conv", i)
        width = ring.shape[-1]
        joined = torch.cat([read_ring(ring, self.start).to(x.dtype), x], dim=-1)  # [B, C, K - 1 + L]
        # the state after the call's position p is joined[..., p + 1:][:K - 1]; kept: the last m positions'
        m = self.kept()
        index = (self.length - m + 1) + torch.arange(m)[:, None] + torch.arange(width)[None, :]
        write_ring(ring, joined[..., index].permute(2, 0, 1, 3), self.start, self.length)  # [m, B, C, K - 1]
        return joined

    def initial(self, i: int) -> torch.Tensor:
        return read_ring(self.ring("recurrent", i), self.start)

    def write_recurrent(self, snaps: torch.Tensor, i: int) -> None:
        write_ring(self.ring("recurrent", i), snaps, self.start, self.length)

    def kept(self):
        """How many states a call keeps: those after its last min(length, snapshots) positions."""
        return kept_states(self.length, self.snapshots)

    # --- the kernels swapped in while tracing ---
    def causal_conv1d_fn(self, x, weight, bias=None, activation=None, **kwargs):
        """The depthwise causal convolution's outputs for the last
        L = len - (K - 1) inputs of x [B, C, len] (what the layer keeps)."""
        from transformers.activations import ACT2FN

        kernel = weight.shape[-1]
        length = x.shape[-1] - (kernel - 1)
        x = x.to(weight.dtype)
        out = sum(x[..., k:k + length] * weight[:, k, None] for k in range(kernel))
        if bias is not None:
            out = out + bias[:, None]
        if activation is not None:
            out = ACT2FN[activation](out)
        return out

    def torch_chunk_gated_delta_rule(self, query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """transformers' gated delta rule ([B, L, H, D] in, the output and the
        layer's snapshots out), on `mlx::gated_delta`."""
        i = self.active
        dtype = query.dtype
        heads = value.shape[2]
        if key.shape[2] != heads:
            query = query.repeat_interleave(heads // key.shape[2], dim=2)
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
        q, k, v, b, decay = (t.transpose(1, 2).to(torch.float32) for t in (query, key, value, beta, g))
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q * q.shape[-1] ** -0.5
        packed = torch.ops.mlx.gated_delta(q, k, v, decay, b, self.initial(i), self.snapshots)
        length = q.shape[2]
        out = packed[:, :, :length].transpose(1, 2).contiguous().to(dtype)
        batch, _, _, dk = k.shape
        snaps = packed[:, :, length:].reshape(batch, heads, self.kept(), dk, v.shape[-1]).permute(2, 0, 1, 3, 4)
        return out, snaps

    # Kimi's delta attention (KDA: Kimi-Linear, Bailing's hybrids): the same rule with g [B, L, H, Dk], a
    # decay per key channel, and the same arguments
    chunk_kimi_delta_attention = torch_chunk_gated_delta_rule

    def mamba2_chunk_scan(self, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        """transformers' Mamba-2 scan ([B, L, H, P] in, the output and the
        layer's snapshots out), on `mlx::ssd_scan`."""
        i = self.active
        batch, length, heads, head_dim = hidden_states.shape
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        x = hidden_states.float()
        groups = B.shape[2]
        b, c = (t.float().repeat_interleave(heads // groups, dim=2) for t in (B, C))
        packed = torch.ops.mlx.ssd_scan(x.transpose(1, 2), dt.float().transpose(1, 2), A.float(), b.transpose(1, 2),
                                        c.transpose(1, 2), self.initial(i), self.snapshots)
        y = packed[:, :, :length].transpose(1, 2).contiguous()  # [B, L, H, P], as transformers' (callers view it)
        if D is not None:
            y = y + x * D[:, None].float()
        n = b.shape[-1]
        snaps = packed[:, :, length:].reshape(batch, heads, self.kept(), n, head_dim)
        snaps = snaps.permute(2, 0, 1, 4, 3)  # [N, B, H, P, state]
        return (y, snaps) if return_final_states else y

    def mamba_selective_scan(self, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                             delta_softplus=False, return_last_state=False, **kwargs):
        """transformers' Mamba-1 scan (x, dt [B, D, L], B and C [B, N, L]; the
        output [B, D, L] and the layer's snapshots out), on `mlx::selective_scan`."""
        i = self.active
        batch, channels, length = hidden_states.shape
        initial = self.initial(i)
        if initial.dim() == 4:  # [B, heads, D / heads, N]: Zamba's layers scan one head at a time, in order
            initial, self.head = initial[:, self.head], self.head + 1
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        x = hidden_states.float()
        packed = torch.ops.mlx.selective_scan(x, dt.float(), A.float(), B.transpose(1, 2).float(),
                                              C.transpose(1, 2).float(), initial, self.snapshots)
        y = packed[:, :, :length]
        if D is not None:
            y = y + x * D[None, :, None].float()
        if z is not None:
            y = y * F.silu(z.float())
        snaps = packed[:, :, length:].reshape(batch, channels, self.kept(), A.shape[1]).permute(2, 0, 1, 3)
        return (y, snaps) if return_last_state else y

    def kernels(self, model: torch.nn.Module):
        """A context within which the model's modeling modules call our kernels."""
        return swapped(model, {name: getattr(self, name) for name in KERNELS})


def make_cache(model, max_context: int, layers: StateLayers):
    """A transformers cache of static attention layers and our state layers."""
    from transformers.cache_utils import (Cache, LinearAttentionAndStaticFullAttentionLayer, LinearAttentionLayer,
                                          StaticLayer, get_layer_types_and_kwargs)
    from transformers.integrations.executorch import get_head_shapes

    class StateLayer(LinearAttentionLayer):
        def __init__(self, index: int):
            super().__init__()
            self.index = index

        def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
            return layers.conv_inputs(conv_states, self.index)

        def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
            if recurrent_states.shape[1:3] != layers.ring("recurrent", self.index).shape[1:3]:
                recurrent_states = recurrent_states.transpose(1, 2)  # Zamba's heads, stacked after our snapshots
            layers.write_recurrent(recurrent_states, self.index)
            return recurrent_states

    class HybridLayer(StateLayer, LinearAttentionAndStaticFullAttentionLayer):
        """A layer keeping keys and values beside its states."""

        def __init__(self, index: int, max_cache_len: int):
            LinearAttentionAndStaticFullAttentionLayer.__init__(self, max_cache_len)
            self.index = index

    class StateCache(Cache):
        """get_conv_state / get_recurrent_state answer None (the layer code then
        takes its prefill path for every call, with no branch on the length)
        and note which layer runs, for the swapped kernels."""

        def get_conv_state(self, layer_idx, state_idx=0):
            layers.active, layers.head = layer_idx, 0
            return None

        def get_recurrent_state(self, layer_idx, state_idx=0):
            layers.active, layers.head = layer_idx, 0
            return None

        def get_seq_length(self, layer_idx=0):
            return layers.start  # what the attention layers hold too (CachedLM sets it each call)

    config = model.config.get_text_config()
    kinds = get_layer_types_and_kwargs(config)[0]
    if not any(layers.keeps_keys(i) for i in range(len(kinds))):
        return StateCache(layers=[StateLayer(i) for i in range(len(kinds))])  # no attention (Mamba-2)
    heads, head_dim = get_head_shapes(config)
    heads = heads if isinstance(heads, list) else [heads] * len(kinds)
    head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * len(kinds)
    cache_layers = []
    for i, kind in enumerate(kinds):
        if not layers.keeps_keys(i):
            cache_layers.append(StateLayer(i))
            continue
        if i in layers.states:
            layer = HybridLayer(i, max_context)
        else:
            layer = StaticLayer(0 if kind == "dummy" else max_context)  # "dummy": a layer of MLP or experts only
        fake = torch.zeros((1, heads[i], 0, head_dim[i]), dtype=model.dtype)
        layer.lazy_initialization(fake, fake)
        cache_layers.append(layer)
    return StateCache(layers=cache_layers)


# The kernels that carry each kind of state in and out of a layer.
KIND_KERNELS = {"conv": ("causal_conv1d_fn",),
                "recurrent": ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan",
                              "mamba_selective_scan")}


def check_state_kernels(model, states: dict[int, dict]) -> None:
    """Every state layer's modeling code runs through kernels we swap
    (KERNELS); a layer of another recurrence is refused by its name."""
    if not has_state_kernels(model):
        raise NotImplementedError(f"{type(model).__name__}'s state layers keep their state through kernels of "
                                  "their own (not the gated delta rule, Mamba's scans or a causal convolution), "
                                  "which export does not build yet")
    for m in model.modules():
        i = getattr(m, "layer_idx", None)
        module = inspect.getmodule(type(m))
        if i not in states or not any(hasattr(module, name) for name in KERNELS):
            continue
        for kind in states[i].keys() & KIND_KERNELS.keys():
            if not any(hasattr(module, name) for name in KIND_KERNELS[kind]):
                raise NotImplementedError(f"{type(m).__name__} keeps a {kind} state through its own kernel (not "
                                          "the gated delta rule, Mamba's scans or a causal convolution), which "
                                          "export does not build yet")


def has_state_kernels(model) -> bool:
    """Whether the model's modeling code has a state kernel we swap."""
    return any(hasattr(inspect.getmodule(type(m)), name) for m in model.modules() for name in KERNELS)


def find_state_layers(model, cache) -> dict[int, dict]:
    """probe_states of `cache` (one_token_cache's) where the modeling code has
    a state kernel or the config names a state layer kind; {} for a model of
    attention layers only."""
    from .export_checks import STATE_LAYERS

    kinds = sorted(set(getattr(model.config.get_text_config(), "layer_types", None) or ()) & STATE_LAYERS)
    if not (kinds or has_state_kernels(model)):
        return {}
    states = probe_states(cache)
    if kinds and not states:
        raise NotImplementedError(f"{type(model).__name__} has {', '.join(kinds)} layers whose state does not go "
                                  "through transformers' state cache (a recurrence of its own), which export does "
                                  "not build yet")
    return states


class StateCachedModel(torch.nn.Module):
    """What transformers' exportable static-cache module is to attention
    models, for models with state layers: `model`, `cache` (static attention
    layers and our state layers), the attention layers' buffers under its
    names (key_cache_{i}, value_cache_{i}, cumulative_length_{i}) and the
    state rings (`states`)."""

    def __init__(self, model, max_context: int, states: dict[int, dict], snapshots: int):
        super().__init__()
        check_state_kernels(model, states)
        self.model = model
        self.states = StateLayers(self, states, snapshots)
        self.cache = make_cache(model, max_context, self.states)
        for i, layer in enumerate(self.cache.layers):
            if self.states.keeps_keys(i):
                self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
                self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
                self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)
