"""HiF8 W8A8 for mixture-of-experts layers: transformers' fused experts modules, quantized per expert.

In transformers 5.x the experts of Mixtral, Qwen2-MoE and Qwen3-MoE are one module with fused 3-D
parameters, ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, and a loop over the experts
that the router picked. :class:`HiF8Experts` replaces such a module, sharing its parameters, and runs
the same loop with the paper's per-tensor delayed scaling applied *per expert*: expert ``e`` has a
:class:`QuantizedProjection` for its gate_up matmul and one for its down matmul, each with its own
input scaler (the tokens routed to ``e``) and weight scaler (``gate_up_proj[e]`` as one tensor: gate and
up share one weight scale and one input scale, as the fused linear of phi3 does; ``down_proj[e]`` its
own). The loop is transformers' eager experts implementation (per-expert matmuls; the grouped_mm kernels
cannot take a per-expert fake quantization), so outputs equal the unquantized model's under
``_experts_implementation="eager"``. Routers and gates are not touched (they stay in high precision). An expert that no token reached
in a step observes nothing, so its history is left alone (the step is not recorded for it).

Everything else is as for :class:`~qat_app.hif8.linear.HiF8Linear`: both are a
:class:`~qat_app.hif8.quantized.QuantizedMatmul` (the same scalers, weight quantization, plan, autograd
function and switches), so the warmup switch, the saturation counters, the batched scaler update and
checkpoints cover the experts too. The 8-bit export stores each fused parameter as per-expert uint8 codes
+ scales; its reader gives each projection its weight slice's codes and scale (``weight_source``:
:mod:`qat_app.export.stored_weight`) so that in eval mode they run on exactly what training computed.
"""

from __future__ import annotations

import torch
from torch import nn

from .quantized import QuantizedMatmul
from .recipe import HiF8Recipe, RuntimeOptions


class QuantizedProjection(QuantizedMatmul):
    """The quantization state of one matmul whose weight lives elsewhere (one expert's slice of a fused
    parameter): scalers, switches, the weight-code cache. ``project(x, weight)`` is ``x @ weight.T``, W8A8."""

    def __init__(self, recipe: HiF8Recipe, runtime: RuntimeOptions, device=None) -> None:
        super().__init__()
        self.init_quantization(recipe, runtime, device)

    def project(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.quantized_matmul(x, weight)


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts layout: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3
            and down.ndim == 3 and gate_up.shape[0] == down.shape[0] and not isinstance(module, HiF8Experts))


class HiF8Experts(nn.Module):
    """A fused experts module with W8A8 per expert (see the module docstring); same parameters, same routing."""

    def __init__(self, experts: nn.Module, recipe: HiF8Recipe, runtime: RuntimeOptions) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        device = experts.gate_up_proj.device
        self.gate_up = nn.ModuleList(QuantizedProjection(recipe, runtime, device) for _ in range(self.num_experts))
        self.down = nn.ModuleList(QuantizedProjection(recipe, runtime, device) for _ in range(self.num_experts))
        object.__setattr__(self, "_original", experts)  # not a submodule: restored by to_float
        self.train(experts.training)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit.flatten().tolist():
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = self.gate_up[expert_idx].project(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = self.down[expert_idx].project(self.act_fn(gate) * up, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states

    # a fused parameter and the projections that quantize its slices, expert by expert
    PARAMS = (("gate_up_proj", "gate_up"), ("down_proj", "down"))

    def projections(self, param: str) -> list[tuple[QuantizedProjection, torch.Tensor]]:
        """(projection, the weight slice its forward passes) of every expert, for ``gate_up_proj`` or ``down_proj``."""
        weight, projections = getattr(self, param), getattr(self, dict(self.PARAMS)[param])
        return [(projections[e], weight[e]) for e in range(self.num_experts)]

    def to_float(self) -> nn.Module:
        """The original experts module (it shares the trained parameters)."""
        original = self._original
        original.gate_up_proj, original.down_proj = self.gate_up_proj, self.down_proj
        original.train(self.training)
        return original
