"""The benchmark tasks with modules of their own: ``TASK_NAMES`` and their :class:`~qat_app.eval.spec.TaskSpec` (one module
each). Any other name in ``data.benchmarks.tasks`` is an lm-eval multiple-choice task (:mod:`qat_app.eval.harness_examples`)."""

from __future__ import annotations

from qat_app.eval import arc, hellaswag, mmlu
from qat_app.eval.spec import TaskSpec

TASK_NAMES: tuple[str, ...] = ("arc_challenge", "hellaswag", "mmlu")

TASK_SPECS: dict[str, TaskSpec] = {spec.name: spec for spec in (arc.SPEC, hellaswag.SPEC, mmlu.SPEC)}


def is_builtin(task: str) -> bool:
    """A task with a module of its own here; any other name is an lm-eval task (:mod:`qat_app.eval.harness_examples`)."""
    return task in TASK_SPECS


def task_spec(task: str) -> TaskSpec:
    if task not in TASK_SPECS:
        from qat_app.errors import ConfigError, did_you_mean

        raise ConfigError(f"data.benchmarks.tasks: unknown benchmark task {task!r}; known tasks: {', '.join(TASK_NAMES)}"
                          + did_you_mean(task, TASK_NAMES))
    return TASK_SPECS[task]
