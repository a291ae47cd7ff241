"""Per-layer numeric comparison: each quantized matmul's HiF8 output against its high-precision output.

The low-bit checklist's per-layer numeric comparison, and the evidence for ``high_precision_layers``:

* :func:`layer_comparison` -- while active, every quantized matmul (dense HiF8Linear and MoE expert projection
  alike) computes its output twice on the SAME input, once in high precision and once fake-quantized as the
  recipe does (with the scales it holds), accumulates the difference in a :class:`LayerError`, and passes the
  high-precision output on. Every layer therefore sees the high-precision model's input: the errors measured
  are each layer's own, they do not compound through the network.
* :func:`calibrate` -- scales for a freshly converted model, as the BF16 warmup makes them: training-mode
  forwards with quantization off (the observers record amax), one scaler step per batch.
* :func:`end_to_end` -- the whole model quantized against the whole model in high precision (errors
  compound): the logits' SQNR and the mean per-token KL(high precision || HiF8).
* :func:`suggest_high_precision_layers` and :func:`exclusion_pattern` -- what to keep in high precision.

SQNR = 10 log10(sum y^2 / sum (y_q - y)^2) over every output element of every batch (a ratio of sums, not a mean
of per-batch decibels); cosine = <y, y_q> / (|y| |y_q|) over the same elements.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from .health import full_kl, sqnr_from_powers
from .operand import Operand
from .patch import block_index, quantized_block_range, quantized_linears, set_quantization
from .recipe import DEFAULT_BLOCK_PATTERN
from .training import start_warmup, sync_and_advance


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """:func:`.health.sqnr_from_powers` of two sums of squares: inf for an exact result, nan without signal."""
    signal, noise = torch.tensor([signal_power, noise_power], dtype=torch.float64)
    return float(sqnr_from_powers(signal, noise))


@dataclass
class LayerError:
    """Sums over every output element a layer produced in the compared batches (float64)."""

    name: str
    block: int | None
    signal: float = 0.0  # sum y^2 (high precision)
    noise: float = 0.0  # sum (y_q - y)^2
    dot: float = 0.0  # sum y * y_q
    quantized_power: float = 0.0  # sum y_q^2
    elements: int = 0

    @torch.no_grad()
    def add(self, reference: torch.Tensor, quantized: torch.Tensor) -> None:
        y, y_q = reference.double(), quantized.double()
        self.signal += float(y.square().sum())
        self.noise += float((y_q - y).square().sum())
        self.dot += float((y * y_q).sum())
        self.quantized_power += float(y_q.square().sum())
        self.elements += y.numel()

    @property
    def sqnr_db(self) -> float:
        """nan when the layer saw no input (an MoE expert no token was routed to)."""
        return sqnr_db(self.signal, self.noise) if self.elements else math.nan

    @property
    def cosine(self) -> float:
        norms = math.sqrt(self.signal * self.quantized_power)
        return self.dot / norms if norms > 0 else math.nan


@contextmanager
def layer_comparison(model: nn.Module, errors: dict[str, LayerError], *, quantize_input: bool = True,
                     quantize_weight: bool = True, block_pattern: str = DEFAULT_BLOCK_PATTERN
                     ) -> Iterator[dict[str, LayerError]]:
    """While active, each quantized matmul of ``model`` returns its high-precision output and adds the error of its
    fake-quantized output (``quantize_input`` / ``quantize_weight``: which operands) on the same input to
    ``errors[name]`` (created on first use; ``block_pattern`` finds its block). Run it in eval mode, so no
    observer records."""
    block_regex = re.compile(block_pattern)
    layers = quantized_linears(model)
    for name, layer in layers:
        error = errors.setdefault(name, LayerError(name, block_index(name, block_regex)))
        layer.quantized_matmul = _compared(layer, layer.quantized_matmul, error, quantize_input, quantize_weight)
    try:
        yield errors
    finally:
        for _, layer in layers:
            del layer.quantized_matmul  # the instance attribute: the class's method again


def _compared(layer, matmul: Callable, error: LayerError, quantize_input: bool, quantize_weight: bool) -> Callable:
    def compared(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        switches = dict(layer.switches)
        try:
            layer.switch(Operand.INPUT, False)
            layer.switch(Operand.WEIGHT, False)
            reference = matmul(x, weight, bias)
            layer.switch(Operand.INPUT, quantize_input)
            layer.switch(Operand.WEIGHT, quantize_weight)
            error.add(reference, matmul(x, weight, bias))
        finally:
            layer.switches = switches
        return reference

    return compared


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], forward: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Delayed scales for a model without amax history: each batch is one training-mode forward with quantization
    off (the BF16 warmup's observation) and one scaler step (:func:`sync_and_advance`); returns the steps taken.
    Leaves the model in eval mode with quantization off."""
    start_warmup(model)
    model.train()
    steps = 0
    for input_ids in batches:
        forward(input_ids)
        sync_and_advance(model)
        steps += 1
    model.eval()
    return steps


@dataclass
class EndToEnd:
    """The whole quantized model against the whole model in high precision, over the compared tokens."""

    logits_signal: float = 0.0
    logits_noise: float = 0.0
    kl_sum: float = 0.0  # sum over tokens of KL(high precision || HiF8), nats
    tokens: int = 0

    @property
    def logits_sqnr_db(self) -> float:
        return sqnr_db(self.logits_signal, self.logits_noise)

    @property
    def kl_per_token(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else math.nan


@torch.no_grad()
def end_to_end(model: nn.Module, input_ids: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
               totals: EndToEnd, *, quantize_input: bool = True, quantize_weight: bool = True) -> torch.Tensor:
    """Add one batch to ``totals`` (errors compound here); returns the high-precision logits."""
    set_quantization(model, weights=False, activations=False)
    reference = forward(input_ids).float()
    set_quantization(model, weights=quantize_weight, activations=quantize_input)
    quantized = forward(input_ids).float()
    set_quantization(model, weights=False, activations=False)
    # float32 logits (a vocabulary-sized tensor per token), float64 sums
    totals.logits_signal += float(reference.square().sum(dtype=torch.float64))
    totals.logits_noise += float((quantized - reference).square().sum(dtype=torch.float64))
    totals.kl_sum += float(full_kl(reference, quantized).sum())
    totals.tokens += reference.shape[:-1].numel()
    return reference


def suggest_high_precision_layers(errors: Iterable[LayerError], num_blocks: int, floor_db: float,
                                  measured_k: int = 0) -> int | None:
    """The rule: the smallest k >= ``measured_k`` (the layout the layers were measured in) for which every measured
    layer in a block that k leaves quantized (all but the first ceil(k/2) and the last floor(k/2)) has SQNR >=
    ``floor_db``; None when no k does (a layer outside the decoder blocks is below the floor)."""
    measured = [e for e in errors if not math.isnan(e.sqnr_db)]
    for k in range(measured_k, num_blocks + 1):
        quantized = quantized_block_range(num_blocks, k)
        if all(e.sqnr_db >= floor_db for e in measured if e.block is None or e.block in quantized):
            return k
    return None


def exclusion_pattern(module_pattern: str, excluded: Iterable[str]) -> str:
    """``module_pattern`` except the named modules: a regex (searched, like the pattern) that matches what
    ``module_pattern`` matches, but none of ``excluded`` (their full names)."""
    names = "|".join(re.escape(name) for name in sorted(excluded))
    return f"^(?!(?:{names})$).*?(?:{module_pattern})"
