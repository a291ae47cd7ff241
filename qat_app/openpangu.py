"""openPangu-Embedded loaded natively, as transformers' own Llama: no remote code.

openPangu-Embedded (``model_type: "PanguEmbedded"``, ``PanguEmbeddedForCausalLM``) ships remote code written
for transformers 4.53 and an Ascend NPU, which does not load on the transformers this project pins. Its
architecture is Llama's (RMSNorm, SwiGLU MLP ``mlp.{gate,up,down}_proj`` without bias, RoPE with
``rope_theta``, GQA) with a bias on ``q/k/v/o_proj`` (``config.bias``), and its parameter names are Llama's, so
the checkpoint loads into :class:`transformers.LlamaForCausalLM` with the :class:`~transformers.LlamaConfig`
that :func:`llama_config` maps from its ``config.json`` (:data:`FIELD_MAP`). Fields a ``config.json`` leaves
out take the upstream ``PanguEmbeddedConfig`` defaults (:data:`UPSTREAM_DEFAULTS`), not Llama's.

The weights are loaded strictly: a missing, unexpected or differently shaped tensor is an
:class:`OpenPanguError` naming the checkpoint. A model loaded this way saves (``save_pretrained``, the HF
export) as a plain Llama directory that plain transformers and lm-eval load.

The tokenizer (upstream: a remote ``PanguTokenizer``, which encodes each chunk between added tokens with
``SentencePieceProcessor.encode`` and prepends ``<s>``) is its ``tokenizer.model`` converted by transformers'
own SentencePiece converter (:class:`~transformers.PreTrainedTokenizerFast`), which follows the SentencePiece
model's own normalizer spec and model type and so encodes like the upstream tokenizer. ``LlamaTokenizer`` does
not: it assumes Llama's normalization (no whitespace folding, no NFKC) and a BPE model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import QATError

log = logging.getLogger(__name__)

OPENPANGU_MODEL_TYPE = "PanguEmbedded"
OPENPANGU_ARCHITECTURE = "PanguEmbeddedForCausalLM"
OPENPANGU_TOKENIZER_CLASS = "PanguTokenizer"

# PanguEmbeddedConfig.__init__'s defaults (configuration_openpangu_dense.py), used for absent fields.
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 153376,
    "hidden_size": 4096,
    "intermediate_size": 12800,
    "num_hidden_layers": 34,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "use_cache": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 45892,
    "tie_word_embeddings": False,
    "rope_theta": 16000000.0,
    "bias": True,
    "attention_dropout": 0.0,  # not a PanguEmbeddedConfig argument, but read by its attention (config.json has it)
}

# openPangu-Embedded-1B, the paper's model, as its config.json describes it: 26 layers, hidden 1536, intermediate 6144,
# 12 heads ("12 for Q, 6 for KV", its model card; vocabulary "153k": the 7B's exact 153376 assumed), the upstream
# defaults otherwise (qat_app.sizing derives the pages' figures from it; the tests build it on the meta device)
OPENPANGU_EMBEDDED_1B: dict[str, Any] = {
    "architectures": [OPENPANGU_ARCHITECTURE], "model_type": OPENPANGU_MODEL_TYPE,
    "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 26, "num_attention_heads": 12,
    "num_key_value_heads": 6, "vocab_size": 153376, "bias": True, "max_position_embeddings": 32768,
}

# openPangu config field -> LlamaConfig field, copied as is. Besides these: rope_theta (+ rope_scaling) ->
# rope_parameters; head_dim (absent or null: hidden_size // num_attention_heads, as upstream); mlp_bias=False
# (upstream's MLP has no bias whatever the config says); num_key_value_heads null -> num_attention_heads.
FIELD_MAP: dict[str, str] = {
    **{key: key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
                            "initializer_range", "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id",
                            "eos_token_id", "tie_word_embeddings", "attention_dropout")},
    "bias": "attention_bias",
}
# config.json bookkeeping that has no bearing on the model.
_IGNORED = {"architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
            "_name_or_path", "name_or_path", "rope_scaling", "rope_theta", "head_dim", "partial_rotary_factor"}


class OpenPanguError(QATError, ValueError):
    """An openPangu checkpoint that cannot be loaded natively; the message names it."""


# ------------------------------------------------------------------------------------------ detection
def is_openpangu_config(config: Mapping | None) -> bool:
    """True for a ``config.json`` of openPangu-Embedded (``model_type`` or ``architectures``)."""
    if not isinstance(config, Mapping):
        return False
    if config.get("model_type") == OPENPANGU_MODEL_TYPE:
        return True
    architectures = config.get("architectures") or []
    return isinstance(architectures, (list, tuple)) and OPENPANGU_ARCHITECTURE in architectures


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_config(src: str, *, local: bool, revision: str | None = None, cache_dir: str | None = None) -> dict | None:
    """The ``config.json`` of a local directory or hub repo as a dict; None when there is none or it is not
    JSON (the ordinary loading path then reports the problem). A hub repo that cannot be reached (offline
    and not cached, no such repo, no network) raises ``OSError``: ``from_pretrained`` could not load it either."""
    if local:
        return _read_json(Path(src) / "config.json")
    # a hub id: the file from_pretrained downloads first (then cached by huggingface_hub)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        path = hf_hub_download(src, "config.json", revision=revision, cache_dir=cache_dir)
    except LocalEntryNotFoundError:  # offline (or unreachable) and not in the cache
        raise
    except EntryNotFoundError:  # the repo has no config.json
        return None
    except OSError:
        raise
    except Exception as err:  # a transport error that is not an OSError
        raise OSError(f"{type(err).__name__}: {err}") from err
    return _read_json(Path(path))


def is_openpangu_tokenizer_dir(src: str) -> bool:
    """A local directory whose ``tokenizer_config.json`` names upstream's remote ``PanguTokenizer``."""
    config = _read_json(Path(src) / "tokenizer_config.json")
    return bool(config) and config.get("tokenizer_class") == OPENPANGU_TOKENIZER_CLASS


# ------------------------------------------------------------------------------------------ config
def _rope_parameters(cfg: Mapping, theta: float, source: str) -> dict:
    factor = cfg.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        # upstream rotates the whole head (apply_rotary_pos_emb has no partial rotary), as Llama does
        raise OpenPanguError(f"openPangu config {source}: partial_rotary_factor={factor} is not supported")
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if not isinstance(scaling, Mapping):
        raise OpenPanguError(f"openPangu config {source}: rope_scaling must be a mapping, got {scaling!r}")
    # upstream: rope_type = rope_scaling.get("rope_type", rope_scaling.get("type")) (BC: "type")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise OpenPanguError(f"openPangu config {source}: rope_scaling has no rope_type: {dict(scaling)}")
    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=rope_type, rope_theta=theta)
    return params


def llama_config(config: Mapping, source: str = "config.json"):
    """The :class:`transformers.LlamaConfig` of an openPangu-Embedded ``config.json`` (a dict)."""
    from transformers import LlamaConfig

    cfg = {**UPSTREAM_DEFAULTS, **{k: v for k, v in config.items()}}
    kwargs = {llama_key: cfg[pangu_key] for pangu_key, llama_key in FIELD_MAP.items()}
    if kwargs["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    try:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (TypeError, ZeroDivisionError):
        raise OpenPanguError(
            f"openPangu config {source}: bad hidden_size / num_attention_heads "
            f"({cfg['hidden_size']!r} / {cfg['num_attention_heads']!r})"
        ) from None
    theta = cfg["rope_theta"]
    kwargs.update(
        head_dim=head_dim,
        mlp_bias=False,
        pretraining_tp=1,
        rope_parameters=_rope_parameters(cfg, theta, source),
        architectures=["LlamaForCausalLM"],
    )
    ignored = sorted(set(config) - set(FIELD_MAP) - _IGNORED)
    if ignored:
        log.debug("openPangu config %s: fields not used by the model, ignored: %s", source, ", ".join(ignored))
    try:
        return LlamaConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise OpenPanguError(f"openPangu config {source} does not map to a Llama config: {err}") from err


def model_from_config(config: Mapping, *, dtype: torch.dtype = torch.float32, source: str = "config.json"):
    """A :class:`transformers.LlamaForCausalLM` built from an openPangu ``config.json`` (freshly initialised;
    build it under ``torch.device("meta")`` for a weightless one)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(config, source)).to(dtype)


# ------------------------------------------------------------------------------------------ loading
def _describe(keys, limit: int = 8) -> str:
    keys = sorted(str(k) for k in keys)
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _where(src: str, local: bool, revision: str | None, cache_dir: str | None) -> tuple[str, dict[str, Any]]:
    """The checkpoint's name in messages (a local one: absolute), and ``from_pretrained``'s ``revision`` and (for a
    hub id) ``cache_dir`` where given."""
    kwargs = {"revision": revision, "cache_dir": None if local else cache_dir}
    return str(Path(src).absolute()) if local else src, {k: v for k, v in kwargs.items() if v is not None}


def load_model(
    src: str,
    config: Mapping,
    *,
    dtype: torch.dtype,
    local: bool,
    revision: str | None = None,
    cache_dir: str | None = None,
):
    """The checkpoint at ``src`` (a directory or hub id) as a :class:`transformers.LlamaForCausalLM`, strictly:
    every tensor of the checkpoint used, every parameter of the model loaded, same shapes."""
    from transformers import LlamaForCausalLM

    name, kwargs = _where(src, local, revision, cache_dir)
    try:
        model, info = LlamaForCausalLM.from_pretrained(
            src, config=llama_config(config, name), dtype=dtype, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, with the other mismatches, as one error
            **kwargs,
        )
    except OSError as err:
        if local:
            raise OpenPanguError(f"openPangu checkpoint {name}: no loadable weights ({err})") from err
        raise
    problems = [f"{what}: {_describe(info[key])}" for key, what in (
        ("missing_keys", "missing from the checkpoint"), ("unexpected_keys", "not in the model (unexpected)"),
        ("mismatched_keys", "shape differs")) if info.get(key)]
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"])))
    if problems:
        raise OpenPanguError(
            f"openPangu checkpoint {name} does not match the Llama layout of its config.json: " + "; ".join(problems)
        )
    return model


def load_tokenizer(src: str, *, local: bool, revision: str | None = None, cache_dir: str | None = None):
    """The openPangu tokenizer (``tokenizer.model``, or a ``tokenizer.json`` if there is one) through
    transformers' own SentencePiece conversion; saved copies load with plain ``AutoTokenizer``."""
    from transformers import PreTrainedTokenizerFast

    name, kwargs = _where(src, local, revision, cache_dir)
    if local and not any((Path(src) / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
        raise OpenPanguError(f"openPangu checkpoint {name} has no tokenizer.model (nor tokenizer.json)")
    # legacy: upstream prefixes every chunk between added tokens
    tok = PreTrainedTokenizerFast.from_pretrained(src, legacy=True, **kwargs)
    # a saved copy must not point AutoTokenizer at the remote tokenization_openpangu.py
    tok.init_kwargs.pop("auto_map", None)
    if tok.init_kwargs.get("tokenizer_class") == OPENPANGU_TOKENIZER_CLASS:
        tok.init_kwargs.pop("tokenizer_class")
    return tok


__all__ = [
    "FIELD_MAP",
    "OPENPANGU_ARCHITECTURE",
    "OPENPANGU_MODEL_TYPE",
    "OpenPanguError",
    "UPSTREAM_DEFAULTS",
    "is_openpangu_config",
    "is_openpangu_tokenizer_dir",
    "llama_config",
    "load_model",
    "load_tokenizer",
    "model_from_config",
    "read_config",
]
