"""Local data files: paths / directories / glob patterns resolved into a checked list of files.

``data_files`` is a path, a directory, a glob pattern or a list of them; ``.parquet``, ``.jsonl``/``.json``
(``.ndjson``), ``.txt``, optionally ``.gz``/``.bz2``/``.xz``/``.zst``/``.lz4`` compressed, all of one format.
:func:`builder_for` names the ``datasets`` builder that reads them (``parquet``, ``json`` or ``text``).
"""

from __future__ import annotations

import glob
import os

from qat_app.data.errors import DataError

_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".txt": "text"}
_GLOB_CHARS = set("*?[")


def _base_extension(path: str) -> str:
    name = path.lower()
    name = next((name[: -len(c)] for c in _COMPRESSION if name.endswith(c)), name)
    return os.path.splitext(name)[1]


def resolve_data_files(data_files: str | os.PathLike | list | tuple) -> list[str]:
    """Expand paths / directories / glob patterns into a sorted, de-duplicated list of files.

    Raises ``FileNotFoundError`` for a missing path or a pattern matching nothing and ``DataError`` for an
    empty (0-byte) file, an unsupported extension or a mix of formats."""
    items = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not items:
        raise DataError("data_files is empty")
    files: list[str] = []
    for item in items:
        item = os.path.expanduser(os.fspath(item))
        if _GLOB_CHARS & set(item):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            unmatched = f"data_files pattern {item!r} matched no files"
        elif os.path.isdir(item):
            matched = sorted(p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                             if os.path.isfile(p) and _base_extension(p) in _BUILDERS)
            unmatched = f"data_files directory {item!r} contains no {'/'.join(sorted(_BUILDERS))} files"
        elif os.path.isfile(item):
            matched, unmatched = [item], ""
        else:
            raise FileNotFoundError(f"data file {item!r} does not exist")
        if not matched:
            raise FileNotFoundError(unmatched)
        files.extend(matched)
    out = list(dict.fromkeys(os.path.abspath(f) for f in files))  # de-duplicated, in order
    for f in out:
        ext = _base_extension(f)
        if ext not in _BUILDERS:
            raise DataError(f"data file {f}: unsupported extension {ext!r} (supported: {sorted(_BUILDERS)})")
        if os.path.getsize(f) == 0:
            raise DataError(f"data file {f} is empty (0 bytes)")
    builders = {_BUILDERS[_base_extension(f)] for f in out}
    if len(builders) > 1:
        raise DataError(f"data_files mixes formats {sorted(builders)}; use files of one format: {out}")
    return out


def builder_for(path: str) -> str:
    """The ``datasets.load_dataset`` builder (``parquet``, ``json`` or ``text``) of a resolved data file."""
    return _BUILDERS[_base_extension(path)]
