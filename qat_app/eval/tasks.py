"""The benchmark tasks by name: ``TASK_NAMES`` and their :class:`~qat_app.eval.spec.TaskSpec` (one module each)."""

from __future__ import annotations

from qat_app.eval import arc, hellaswag, mmlu
from qat_app.eval.spec import TaskSpec

TASK_NAMES: tuple[str, ...] = ("arc_challenge", "hellaswag", "mmlu")

TASK_SPECS: dict[str, TaskSpec] = {spec.name: spec for spec in (arc.SPEC, hellaswag.SPEC, mmlu.SPEC)}


def task_spec(task: str) -> TaskSpec:
    if task not in TASK_SPECS:
        from qat_app.errors import ConfigError, did_you_mean

        raise ConfigError(f"data.benchmarks.tasks: unknown benchmark task {task!r}; known tasks: {', '.join(TASK_NAMES)}"
                          + did_you_mean(task, TASK_NAMES))
    return TASK_SPECS[task]
