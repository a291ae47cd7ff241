"""The models ``main.py evaluate`` scores: a checkpoint's QAT model under its run's precision, a plain model, the
initial model a checkpoint started from; and the check that a baseline is the same model."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass
class Evaluated:
    """A model to score: the HF model object, its tokenizer, what it is and the context its forwards run under."""

    model: object
    tokenizer: object
    label: str  # what the user named
    quantized: bool
    precision: str | None = None
    base: dict = field(default_factory=dict)  # model_name / gguf_file / dtype of the model a checkpoint started from

    def forward_context(self):
        """The run's mixed precision (autocast) around every forward; a context manager factory."""
        import torch

        dtype = _precision_dtype(self.precision)
        if dtype is not None and str(self.precision).endswith("mixed"):
            device = next(self.model.parameters()).device.type
            return lambda: torch.autocast(device, dtype=dtype)
        return nullcontext


def _precision_dtype(precision: str | None):
    """The dtype a Lightning precision computes in (None: float32 or unknown)."""
    import torch

    from ..precision import PRECISION_DTYPES

    dtype = PRECISION_DTYPES.get(str(precision))
    return None if dtype in (None, "float32") else getattr(torch, dtype)


def in_run_precision(model, precision: str | None):
    """``model`` as the run computed: Lightning's ``-true`` precisions hold the whole model in their dtype (the
    ``-mixed`` ones autocast its forwards: :meth:`Evaluated.forward_context`)."""
    dtype = _precision_dtype(precision)
    return model.to(dtype) if dtype is not None and not str(precision).endswith("mixed") else model


def is_checkpoint(path: str) -> bool:
    from ..sharded_checkpoint import looks_sharded

    return os.path.isfile(path) or (os.path.isdir(path) and looks_sharded(path))


def load_evaluated(path: str, device: str, dtype: str, trust_remote_code: bool) -> Evaluated:
    """A checkpoint (file or sharded FSDP2 directory) as its QAT model; anything else as a plain model
    (``qat_app.models``: hub id, local directory, GGUF, the embedded default)."""
    if is_checkpoint(path):
        from ..export.qat_checkpoint import load_qat_checkpoint
        from .noise_floor import _quantizes

        module = load_qat_checkpoint(path, trust_remote_code=trust_remote_code)
        model = in_run_precision(module.model.eval(), module.run_precision)
        hparams = dict(module.hparams)
        base = {"model_name": hparams.get("model_name"), "gguf_file": hparams.get("gguf_file"),
                "dtype": hparams.get("dtype", "float32")}
        return Evaluated(model.to(device), module.tokenizer, path, _quantizes(model), module.run_precision, base)
    from ..models import load_causal_lm

    model, tokenizer = load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return Evaluated(model.eval().to(device), tokenizer, path, False)


def load_baseline(spec: str, evaluated: Evaluated, device: str, dtype: str, trust_remote_code: bool) -> Evaluated | None:
    """``initial``: the checkpoint's base model, unquantized, under the same precision; ``none``; or another run or
    model, which must be the same model (architecture and tokenizer)."""
    if spec == "none":
        return None
    if spec == "initial":
        if not evaluated.base:
            raise ConfigError(f"--baseline initial: {evaluated.label} is a plain model, not a checkpoint; it is its own "
                              "initial model (name another model, or --baseline none)")
        from ..models import load_causal_lm

        model, tokenizer = load_causal_lm(evaluated.base["model_name"], gguf_file=evaluated.base["gguf_file"],
                                          dtype=evaluated.base["dtype"], trust_remote_code=trust_remote_code)
        model = in_run_precision(model.eval(), evaluated.precision).to(device)
        baseline = Evaluated(model, tokenizer, f"initial ({evaluated.base['model_name']})", False, evaluated.precision)
    else:
        baseline = load_evaluated(spec, device, dtype, trust_remote_code)
    check_same_model(evaluated, baseline)
    return baseline


ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")


def check_same_model(evaluated: Evaluated, baseline: Evaluated) -> None:
    """Refuse a baseline of another model: another architecture, shape or tokenizer (one line naming both)."""
    if evaluated.base and baseline.base and evaluated.base["model_name"] != baseline.base["model_name"]:
        raise ConfigError(f"--baseline {baseline.label}: a checkpoint of {baseline.base['model_name']!r}, but "
                          f"{evaluated.label} trained {evaluated.base['model_name']!r}")
    a, b = evaluated.model.config, baseline.model.config
    differ = [f"{name} {getattr(a, name, None)} vs {getattr(b, name, None)}" for name in ARCHITECTURE_FIELDS
              if getattr(a, name, None) != getattr(b, name, None)]
    if evaluated.tokenizer.get_vocab() != baseline.tokenizer.get_vocab():
        differ.append("the tokenizers' vocabularies differ")
    if differ:
        raise ConfigError(f"--baseline {baseline.label}: another model than {evaluated.label} ({'; '.join(differ)})")
