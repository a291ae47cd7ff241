"""The benchmark tasks by name: ``TASK_NAMES`` and their :class:`~qat_app.eval.spec.TaskSpec` (one module each)."""

from __future__ import annotations

from qat_app.eval import arc, hellaswag, mmlu
from qat_app.eval.spec import TaskSpec

TASK_NAMES: tuple[str, ...] = ("arc_challenge", "hellaswag", "mmlu")

TASK_SPECS: dict[str, TaskSpec] = {spec.name: spec for spec in (arc.SPEC, hellaswag.SPEC, mmlu.SPEC)}


def task_spec(task: str) -> TaskSpec:
    if task not in TASK_SPECS:
        from difflib import get_close_matches

        from qat_app.errors import ConfigError

        close = get_close_matches(str(task), TASK_NAMES, n=1, cutoff=0.6)
        raise ConfigError(f"data.benchmarks.tasks: unknown benchmark task {task!r}; known tasks: {', '.join(TASK_NAMES)}"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    return TASK_SPECS[task]
