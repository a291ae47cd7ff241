"""GGUF checkpoints made plain, and the embedded model's safetensors cache.

GGUF checkpoints are de-quantised by transformers (``gguf_file=``, needs ``gguf`` + ``accelerate``). A
GGUF-loaded model refuses ``save_pretrained``, so every GGUF-loaded model is rebuilt as a plain model
(:func:`dequantized_copy`: ``from_config`` + ``load_state_dict``, tied ``lm_head``/``embed_tokens`` kept tied).

The embedded model (:data:`~.source.EMBEDDED_MODEL`) is converted once and cached as safetensors + config +
tokenizer under ``<cache_dir>/<name>`` where ``cache_dir`` defaults to ``$QAT_APP_CACHE/models`` (or
``~/.cache/qat_app/models``). The cache is written to a temporary directory and renamed into place
(atomic), under a file lock so that concurrent DDP ranks convert only once; a ``qat_app_source.json``
records the GGUF it came from and a stale cache (other package version / file) is rebuilt.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .source import EMBEDDED_MODEL, EMBEDDED_MODELS, embedded_gguf_path, embedded_key

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1
SOURCE_FILE = "qat_app_source.json"


def cache_root() -> Path:
    """Root of the application cache: ``$QAT_APP_CACHE`` or ``~/.cache/qat_app``."""
    return Path(os.environ.get("QAT_APP_CACHE") or "~/.cache/qat_app").expanduser()


def default_model_cache_dir() -> Path:
    return cache_root() / "models"


def finish_tokenizer(tok, name: str):
    """The tokenizer with a pad token (= eos when it has none); refuses one without an eos token."""
    if tok.eos_token is None:
        raise ValueError(f"tokenizer of {name!r} has no eos token (needed to separate packed documents)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# --------------------------------------------------------------------------------------------- GGUF
def dequantized_copy(model):
    """Rebuild a GGUF-loaded (non-serialisable) model as a plain ``PreTrainedModel`` with the same
    weights (``from_config`` + ``load_state_dict``); tied embeddings stay tied."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    dtype = next(model.parameters()).dtype
    new = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"GGUF re-build mismatch: missing={missing} unexpected={unexpected}")
    if getattr(cfg, "tie_word_embeddings", False):
        new.tie_weights()
    try:
        new.generation_config = copy.deepcopy(model.generation_config)
    except Exception:  # pragma: no cover - generation config is optional
        pass
    new.eval()
    return new


# --------------------------------------------------------------------------------------------- the cache
def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_record(name: str, gguf: Path) -> dict:
    dist = EMBEDDED_MODELS[embedded_key(name)][2]
    import transformers

    return {
        "format": _CACHE_FORMAT,
        "name": name,
        "gguf_file": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "package": dist,
        "package_version": _dist_version(dist),
        "transformers_version": transformers.__version__,
    }


def _cache_is_valid(path: Path, record: dict) -> bool:
    try:
        saved = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format", "gguf_file", "gguf_size", "package_version")
    return all(saved.get(k) == record.get(k) for k in keys) and (path / "config.json").is_file()


def embedded_model_dir(name: str = EMBEDDED_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the converted embedded model, converting (once, atomically) if needed."""
    gguf = embedded_gguf_path(name)
    key = embedded_key(name)
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_model_cache_dir()
    target = parent / key
    record = _source_record(name, gguf)
    if _cache_is_valid(target, record):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(parent / f".{key}.lock")):
        if _cache_is_valid(target, record):  # another process converted it while we waited
            return target
        _convert_gguf_to_cache(gguf, target, record)
    return target


def _chmod_like_umask(directory: Path) -> None:
    """mkdtemp creates 0700 (and some writers 0600): give the cache the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for p in directory.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)


def _convert_gguf_to_cache(gguf: Path, target: Path, record: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors cache at %s (once)", gguf, target)
    tok = finish_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), record["name"])
    gmodel = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = dequantized_copy(gmodel)
    del gmodel
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2))
        _chmod_like_umask(tmp)
        old = None
        if target.exists():  # stale cache: move it aside, then swap in the new one
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=str(target.parent)))
            os.rename(target, old / "x")
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
