"""Mixture-of-experts layers for export.

transformers stores a family's experts as 3-D weights in one module (the
classes under its `@use_experts_implementation`: Qwen2/3-MoE, Mixtral,
GraniteMoE, gpt-oss, OLMoE, ...) and runs them, by default, in a loop over
the experts a batch hits (`nonzero`, data-dependent shapes that neither
torch.export nor a static graph takes). `route_experts` gives each such
module a forward of ours: every row goes through its k experts with
`mlx::gather_linear` (custom_kernel_ops/experts.py), one IR node per
projection that reads only the chosen experts' weights, then the k outputs
are weighted and summed. The router (top-k over the gate's logits, softmax or
sigmoid, normalisation, shared experts) stays the family's own code, which
lowers as ordinary ops.
"""

from __future__ import annotations

import types

import torch

from ...custom_kernel_ops import experts as _experts_ops  # noqa: F401  (defines the ops)
from ...lowering.weight_files import keep


def is_experts_module(module: torch.nn.Module) -> bool:
    """A transformers experts module (what `@use_experts_implementation` sets
    up), its weights in full precision or quantized (llm/export/quantize.py)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and \
        (isinstance(getattr(module, "down_proj", None), torch.Tensor) or hasattr(module, "down_proj_quantized"))


def projections(module: torch.nn.Module) -> tuple[str, str]:
    """The names of the module's two expert weights, input side first."""
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


def _project(module: torch.nn.Module, name: str, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    bias = getattr(module, f"{name}_bias") if module.has_bias else None
    quantized = getattr(module, f"{name}_quantized", None)  # llm/export/quantize.py
    if quantized is not None:
        return quantized(x, indices, bias)
    return torch.ops.mlx.gather_linear(x, getattr(module, name), indices, bias)


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], the router's expert ids and weights [T, k] -> [T, H]."""
    first, down = projections(self)
    h = _project(self, first, hidden_states, top_k_index)  # [T, k, N]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _project(self, down, h, top_k_index)  # [T, k, H]
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1).to(hidden_states.dtype)


def _split_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return up * self.act_fn(gate)


def _llama4_moe_forward(self, hidden_states: torch.Tensor):
    """Llama 4's layer: each row scaled by the sigmoid of its top-k router
    logits goes through those k experts (its own code runs every expert on
    every row, the others scaled by 0), plus the shared expert."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.router.weight)
    top, indices = torch.topk(logits, self.router.top_k, dim=1)
    rows = x[:, None, :] * torch.sigmoid(top.float()).to(x.dtype)[..., None]  # [T, k, H]
    h = self.experts._apply_gate(_project(self.experts, "gate_up_proj", rows, indices))
    routed = _project(self.experts, "down_proj", h, indices).sum(dim=1)
    return self.shared_expert(x) + routed, logits


def _zero_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """LongCat-Flash's experts: ids past the routed experts are zero-computation
    experts that hand the row on as it is."""
    routed = top_k_index < self.num_routed_experts
    ids = torch.where(routed, top_k_index, 0)
    out = _project(self, "down_proj", self._apply_gate(_project(self, "gate_up_proj", hidden_states, ids)), ids)
    out = torch.where(routed.unsqueeze(-1), out, hidden_states.unsqueeze(1).to(out.dtype))
    return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1).to(hidden_states.dtype)


def _dbrx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """DBRX's experts take [B, S, H] and return that shape."""
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    return _experts_forward(self, rows, top_k_index, top_k_weights).view(hidden_states.shape)


def _as_common_experts(experts: torch.nn.Module, transposed: bool, forward=_experts_forward) -> None:
    """Marks an experts module of a family's own as one of the common kind
    (gated: act(gate) * up, no biases), with the forward route_experts gives it."""
    experts.has_gate, experts.has_bias, experts.has_post_expert_norm = True, False, False
    experts.is_transposed = transposed
    experts._apply_gate = types.MethodType(_split_gate, experts)
    experts._routed_forward = forward


def _adopt_dbrx_experts(experts: torch.nn.Module) -> None:
    """DBRX's experts (gate, up and down weights [E * F, H] each, in a GLU
    module of their own) as an experts module of the common kind."""
    glu = experts.mlp
    shape = (experts.num_experts, experts.ffn_hidden_size, experts.hidden_size)
    with torch.no_grad():
        gate_up = torch.cat([glu.w1.view(shape), glu.v1.view(shape)], dim=1)
        down = glu.w2.view(shape).transpose(1, 2).contiguous()
    experts.gate_up_proj = torch.nn.Parameter(keep(gate_up), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(keep(down), requires_grad=False)
    experts.act_fn = glu.activation_fn
    del experts.mlp
    _as_common_experts(experts, transposed=False, forward=_dbrx_experts_forward)


def _adopt_dense_experts(model: torch.nn.Module) -> None:
    """Llama 4's experts (weights [E, K, N], every expert run on every row)
    made an experts module of the common kind, its layer routed by
    `_llama4_moe_forward`; LongCat-Flash's (weights of the common kind, its
    own loop) and DBRX's too."""
    for module in model.modules():
        if type(module).__name__ == "Llama4TextMoe" and not is_experts_module(module.experts):
            _as_common_experts(module.experts, transposed=True)
            module.forward = types.MethodType(_llama4_moe_forward, module)
        if type(module).__name__ == "DbrxExperts" and hasattr(module, "mlp"):
            _adopt_dbrx_experts(module)
        if type(module).__name__ == "LongcatFlashExperts" and module.down_proj is not None:
            _as_common_experts(module, transposed=False,
                               forward=_zero_experts_forward if module.zero_expert_num else _experts_forward)


def route_experts(model: torch.nn.Module) -> list[str]:
    """Gives every experts module of `model` our forward, in place, with its
    weights in one layout, [E, N, K] (gpt-oss stores [E, K, N]); returns the
    modules' names. Routing twice changes nothing."""
    _adopt_dense_experts(model)
    names = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        if module.is_transposed:
            for weight in projections(module):
                param = getattr(module, weight)
                # (into a file while export runs: lowering/weight_files.py)
                setattr(module, weight, torch.nn.Parameter(keep(param.detach().transpose(1, 2).contiguous()),
                                                           requires_grad=False))
            module.is_transposed = False
        module.forward = types.MethodType(getattr(module, "_routed_forward", _experts_forward), module)
        names.append(name)
    return names


def check_experts_routed(model: torch.nn.Module, routed: list[str]) -> None:
    """An experts module we do not route (an older layout, a list of MLP
    modules or weights of its own, run in a loop over the experts a batch
    hits) is an error naming it; layers that pick experts with static shapes
    (Doge's, embedding rows per expert) lower as ordinary ops."""
    inside = tuple(f"{r}." for r in routed)  # a routed module's own parts (its quantized weights)
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts") and name not in routed and not name.startswith(inside):
            raise NotImplementedError(f"{type(module).__name__} ({name}) runs its experts in a loop over the ones "
                                      "a batch hits (not transformers' experts modules), which export does not "
                                      "lower yet")
