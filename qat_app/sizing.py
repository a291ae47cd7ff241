"""What a model's shape implies, computed from the model itself (built on the meta device: no weights, no memory):
its parameters, the linears HiF8 quantizes, and the bytes a GPU holds for the weights, the training state
(fp32 master weights, gradients and AdamW's two moments: 16 bytes a parameter under DDP) and a distillation
teacher (BF16). The pages' figures are generated from here (``docs/_hooks/model_sizes.py``), never typed.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# bytes a parameter: what DDP holds on every GPU while training (fp32 weights, gradients, AdamW's m and v)
TRAINING_STATE_BYTES = 4 + 4 + 8
BF16_BYTES = 2


@dataclass(frozen=True)
class ModelSizes:
    """A model's sizes: parameters (each tensor once: tied embeddings count once), and of them the quantized
    linears' (``high_precision_layers`` boundary blocks in BF16)."""

    name: str
    parameters: int
    blocks: int
    quantized_linears: int
    quantized_parameters: int
    high_precision_layers: int

    def gib(self, bytes_per_parameter: int) -> float:
        return self.parameters * bytes_per_parameter / GIB

    @property
    def training_state_gib(self) -> float:
        """fp32 master weights + gradients + AdamW state, per GPU under DDP (sharded over the GPUs by FSDP2)."""
        return self.gib(TRAINING_STATE_BYTES)

    @property
    def teacher_gib(self) -> float:
        """A distillation teacher: one more copy of the weights in BF16."""
        return self.gib(BF16_BYTES)


def model_sizes(model, name: str, high_precision_layers: int = 5) -> ModelSizes:
    """The sizes of ``model`` (any module, meta tensors included) with the paper's layer selection."""
    from qat_app.hif8.patch import select_modules
    from qat_app.hif8.recipe import LayerSelection

    selected = select_modules(model, LayerSelection(high_precision_layers=high_precision_layers))
    parameters = sum(p.numel() for p in model.parameters())  # shared tensors once
    quantized = sum(p.numel() for _, module in selected.modules for p in module.parameters())
    return ModelSizes(name, parameters, selected.num_blocks, len(selected.modules), quantized, high_precision_layers)


def openpangu_1b() -> ModelSizes:
    """openPangu-Embedded-1B, the paper's model (:data:`qat_app.openpangu.OPENPANGU_EMBEDDED_1B`)."""
    import torch

    from qat_app.openpangu import OPENPANGU_EMBEDDED_1B, model_from_config

    with torch.device("meta"):
        model = model_from_config(OPENPANGU_EMBEDDED_1B)
    return model_sizes(model, "openPangu-Embedded-1B")


def embedded_default() -> ModelSizes:
    """The embedded SmolLM2-135M-Instruct (its GGUF's config: nothing downloaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qat_app.models.embedded import embedded_model_dir

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(embedded_model_dir()))
    return model_sizes(model, "SmolLM2-135M-Instruct")
