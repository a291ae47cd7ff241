"""Loading ``(model, tokenizer)`` from a :class:`~.source.ModelSource` resolved once."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from .. import openpangu
from ..errors import ConfigError
from .embedded import dequantized_copy, embedded_model_dir, finish_tokenizer
from .source import EMBEDDED_MODEL, ModelSource, ModelSourceError

log = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, field: str = "model.dtype") -> torch.dtype:
    """``"bfloat16"/"bf16"/"float32"/"fp32"/"float16"/"fp16"`` (also ``"torch.bfloat16"``) or a floating
    ``torch.dtype`` -> ``torch.dtype``; anything else raises ``ValueError`` listing the choices."""
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
        raise ConfigError(f"{field} must be a floating point dtype, got {dtype}")
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key.startswith("torch."):
            key = key[len("torch.") :]
        if key in _DTYPES:
            return _DTYPES[key]
    raise ConfigError(f"{field}={dtype!r} is not a floating point dtype the weights can be stored in; use one of "
                      f"{', '.join(sorted(_DTYPES))} (float8 is what QAT simulates, not a storage dtype)")


def check_finite_weights(model, name: str) -> None:
    """Refuse weights holding NaN / inf (a corrupt or overflowed checkpoint): every training step would be
    skipped as non-finite and the run would save an untrained model. One pass over the weights, at load."""
    named = list(model.named_parameters())
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]) if named else torch.ones(0, dtype=torch.bool)
    if not bool(finite.all()):  # one host sync; the names only when something is wrong
        bad = [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
        raise ModelSourceError(
            f"model.model_name={name}: {len(bad)} of {len(named)} weight tensors hold NaN or inf (first: "
            f"{', '.join(bad[:3])}); the checkpoint is corrupt, so every training step would be skipped")


def _check_tied(model) -> None:
    if getattr(model.config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            model.tie_weights()


@contextmanager
def _hub_errors(source: ModelSource):
    """A hub id's ``OSError`` becomes a :class:`ModelSourceError` naming the setting; a local error passes."""
    try:
        yield
    except OSError as e:
        if source.kind != "hub":
            raise
        raise source.hub_error(e) from e


def _tokenizer(source: ModelSource, converted=None):
    """The tokenizer of a resolved source (``converted``: the embedded model's cache directory)."""
    from transformers import AutoTokenizer

    if source.kind == "embedded":
        converted = converted or embedded_model_dir(source.name, source.cache_dir)
        return finish_tokenizer(AutoTokenizer.from_pretrained(str(converted)), source.name)
    with _hub_errors(source):
        if source.openpangu_tokenizer:
            if source.trust_remote_code:
                log.debug("%s: openPangu-Embedded tokenizer loaded without remote code (trust_remote_code unused)",
                          source.name)
            tok = openpangu.load_tokenizer(source.path, local=source.local, revision=source.revision,
                                           cache_dir=source.cache_dir)
        else:
            kwargs = source.hub_kwargs()
            if source.gguf_file is not None:
                kwargs["gguf_file"] = source.gguf_file
            tok = AutoTokenizer.from_pretrained(source.path, **kwargs)
    return finish_tokenizer(tok, source.name)


def _model(source: ModelSource, dtype: torch.dtype, converted=None):
    from transformers import AutoModelForCausalLM

    if source.kind == "embedded":
        return AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype)
    with _hub_errors(source):
        if source.is_openpangu:
            model = openpangu.load_model(source.path, source.openpangu_config, dtype=dtype, local=source.local,
                                         revision=source.revision, cache_dir=source.cache_dir)
            log.info(
                "%s is openPangu-Embedded: loaded natively as transformers' LlamaForCausalLM, without remote code%s",
                source.name,
                " (trust_remote_code=True is not needed for it and was not used)" if source.trust_remote_code else "",
            )
            return model
        if source.gguf_file is not None:
            # GGUF weights are de-quantised to float32, rebuilt as a plain (serialisable) model, then cast.
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32,
                                                         **source.hub_kwargs())
            model = dequantized_copy(model)
            return model if dtype == torch.float32 else model.to(dtype)
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **source.hub_kwargs())


# --------------------------------------------------------------------------------------------- API
def load_tokenizer(
    name_or_path: str = EMBEDDED_MODEL,
    *,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    cache_dir: str | None = None,
):
    """Tokenizer for a hub id / local dir / :data:`EMBEDDED_MODEL`, with a pad token (= eos if missing)."""
    source = ModelSource.resolve(name_or_path, gguf_file, revision=revision, cache_dir=cache_dir,
                                 trust_remote_code=trust_remote_code)
    return _tokenizer(source)


def load_causal_lm(
    name_or_path: str = EMBEDDED_MODEL,
    *,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
    cache_dir: str | None = None,
):
    """Load ``(model, tokenizer)``.

    ``cache_dir``: for :data:`EMBEDDED_MODEL` the directory holding the converted copy (``<cache_dir>/<name>``,
    default ``$QAT_APP_CACHE/models`` or ``~/.cache/qat_app/models``); for hub ids it is forwarded to
    ``from_pretrained`` as the Hugging Face download cache. The model is returned in eval mode with
    ``config.pad_token_id`` set from the tokenizer when missing. An openPangu-Embedded checkpoint comes back as
    a ``LlamaForCausalLM`` (:mod:`qat_app.openpangu`) whatever ``trust_remote_code`` says.
    """
    torch_dtype = resolve_dtype(dtype)
    source = ModelSource.resolve(name_or_path, gguf_file, revision=revision, cache_dir=cache_dir,
                                 trust_remote_code=trust_remote_code)
    converted = embedded_model_dir(source.name, source.cache_dir) if source.kind == "embedded" else None
    tok = _tokenizer(source, converted)
    model = _model(source, torch_dtype, converted)
    _check_tied(model)
    check_finite_weights(model, name_or_path)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok
