"""ForgettingMonitor: catastrophic forgetting seen while training, against the initial model, with alarms.

Every validation after the step-0 pass pairs the current benchmark records with the initial model's
(:func:`qat_app.eval.measures.compare_records`) and logs, per task and monitored measure,
``forget/<task>/<measure>`` with its 95 % interval (``_low`` / ``_high``). An accuracy-type measure alarms when its
corrected interval excludes 0 on the worse side, a drift measure when the interval lies wholly above its budget.
Contract: the chance of any false alarm over the whole run is at most ``level`` (Bonferroni over the planned
looks, :func:`planned_validations`). ``action="stop"`` also saves a checkpoint and stops the fit. A resumed fit
compares with the run's original step-0 records; a missing or changed file turns the monitor off, with a warning.

See ``docs/diagnostics/forgetting.md`` ("Forgetting alarms") for the measures, the rule and the settings.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
from typing import Literal, Optional

import lightning as L
import torch

from qat_app import stats
from qat_app.errors import ConfigError, did_you_mean
from qat_app.eval.kl_cache import DRIFT, KL, with_interval
from qat_app.eval.measures import MEASURES, MeasureError, compare_records, resolve_measures, verdict
from qat_app.eval.records import SAMPLES_DIR, read_records, records_path

from .per_step import callback_of, validation_log_step
from .stopping import stop_with_checkpoint

log = logging.getLogger(__name__)

DEFAULT_MEASURES = ("acc_norm", "p_gold_norm")
ACTIONS = ("warn", "stop")
KL_PARTS = {"drift": DRIFT, "total": KL}  # forgetting.kl_budget_part -> the metric the budget bounds
STOP_FILE = "forgetting-stop-step={step}.ckpt"
INITIAL_FILE = os.path.basename(records_path("", "val", 0))  # val_step0000000.jsonl
CAUSE = ("the usual cause is too high a learning rate (catastrophic forgetting: the paper's lr 1e-4 forgets "
         "ARC-Challenge and HellaSwag, 1e-5 does not); lower model.lr")


# ------------------------------------------------------------------------------------- the decision rule
def planned_validations(trainer) -> int | None:
    """The validations a fit will run after step 0, from ``max_steps`` x ``accumulate_grad_batches`` training
    batches and Lightning's ``val_check_batch`` (``val_check_interval`` in batches); an upper bound (a last
    partial interval counts), None when it cannot be known (time-based validation, unsized epochs without
    max_steps)."""
    batches_per_check = getattr(trainer, "val_check_batch", None)
    max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    total = max_steps * max(1, int(trainer.accumulate_grad_batches)) if max_steps else None
    if batches_per_check is None or not batches_per_check > 0:
        return None
    every_epochs = trainer.check_val_every_n_epoch
    if every_epochs is None:  # checks counted over all training batches
        return None if total is None or math.isinf(batches_per_check) else max(1, math.ceil(total / batches_per_check))
    per_epoch = trainer.num_training_batches
    max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
    epochs = max_epochs
    if total is not None and not math.isinf(per_epoch) and per_epoch > 0:
        epochs = min(math.ceil(total / per_epoch), max_epochs or math.inf)
    if epochs is None or math.isinf(epochs):
        return None
    checks = 1 if math.isinf(batches_per_check) or math.isinf(per_epoch) else max(1, int(per_epoch // batches_per_check))
    return max(1, int(epochs) // every_epochs) * checks


def look_alpha(level: float, look: int, planned: int | None, pairs: int) -> float:
    """One-sided false-alarm rate of each of ``pairs`` tests at look ``look`` (1-based): Bonferroni
    ``level / (planned x pairs)``, or without a plan the spending ``level / (look (look + 1) pairs)``
    (sum over looks = level)."""
    pairs = max(1, pairs)
    if planned:
        return level / (planned * pairs)
    return level / (look * (look + 1) * pairs)


def is_alarm(measure: str, result: stats.PairedResult, budget: float | None = None) -> bool:
    """An accuracy measure worse than 0, or a drift measure over ``budget`` (at ``result``'s own level)."""
    return verdict(measure, result, budget) in ("worse", "over budget")


# ----------------------------------------------------------------------------------------- the records
def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def initial_records_candidates(trainer, log_dir: str | None) -> list[str]:
    """Step-0 record files under the loggers' roots (every version of the run), newest first. ``log_dir``: the
    caller's ``trainer.log_dir``, read on every rank (it is a broadcast; this runs on rank 0 alone)."""
    roots = []
    for logger in trainer.loggers:
        root = getattr(logger, "root_dir", None) or getattr(logger, "save_dir", None)
        if root:
            roots.append(root)
    if log_dir:
        roots.append(os.path.dirname(os.path.normpath(log_dir)))
    found = {os.path.abspath(p) for root in dict.fromkeys(roots)
             for p in glob.glob(os.path.join(glob.escape(root), "*", SAMPLES_DIR, INITIAL_FILE))}
    return sorted(found, key=os.path.getmtime, reverse=True)


def benchmark_tasks(datamodule) -> list[str]:
    bench = getattr(datamodule, "benchmarks", None) or datamodule
    return list(getattr(bench, "task_names", None) or [])


class ForgettingMonitor(L.Callback):
    """Forgetting alarms: every validation's benchmarks and KL against the initial model.

    Args:
        enabled: null (default): on whenever the initial evaluation runs (``initial_eval.enabled`` and
            benchmarks), silently off otherwise (said once in the log); true: required (an error without the
            initial evaluation); false: off.
        measures: the measures compared and logged (:data:`qat_app.eval.measures.MEASURES`); accuracy-type ones
            alarm when worse than the initial model, drift ones only against a budget.
        tasks: the benchmark tasks to monitor (null: every evaluated task).
        level: the family-wise false-alarm rate over the whole run, in (0, 1) (Bonferroni over the planned
            validations x the monitored pairs).
        kl_budget: nats per token for the KL to the initial model on held-out text; null: no alarm.
        kl_budget_part: what ``kl_budget`` bounds: ``drift`` (default, ``forget/kl_drift``: KL(initial || now with
            quantization off), what training moved) or ``total`` (``forget/kl``, which also holds what HiF8
            changes: present from the first QAT step at any learning rate, so a budget on it alarms on
            quantization, not forgetting). Without the parts (``initial_eval.kl_parts`` false) ``drift`` falls
            back to ``forget/kl``, said once in the log.
        kl_choices_budget: nats for ``kl_choices`` (KL between the initial and current choice distributions),
            per task; null: no alarm (set it to monitor ``kl_choices``).
        action: ``warn`` (one log line per alarm) or ``stop`` (also save a checkpoint, stop, print the resume
            command).
    """

    def __init__(self, enabled: Optional[bool] = None, measures: list[str] = list(DEFAULT_MEASURES),
                 tasks: Optional[list[str]] = None, level: float = 0.05, kl_budget: Optional[float] = None,
                 kl_choices_budget: Optional[float] = None, action: Literal["warn", "stop"] = "warn",
                 kl_budget_part: Literal["drift", "total"] = "drift") -> None:
        names = [m.name for m in resolve_measures(list(measures), where="forgetting.measures")]
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
            raise ConfigError(f"forgetting.level: the family-wise false-alarm rate must lie in (0, 1), got {level!r}")
        for field, budget in (("kl_budget", kl_budget), ("kl_choices_budget", kl_choices_budget)):
            if budget is not None and not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
                raise ConfigError(f"forgetting.{field}: must be a number >= 0 (nats) or null, got {budget!r}")
        if action not in ACTIONS:
            raise ConfigError(f"forgetting.action: unknown action {action!r}{did_you_mean(action, ACTIONS)}; "
                              f"allowed: {', '.join(ACTIONS)}")
        if kl_budget_part not in KL_PARTS:
            raise ConfigError(f"forgetting.kl_budget_part: unknown part {kl_budget_part!r}"
                              f"{did_you_mean(kl_budget_part, KL_PARTS)}; allowed: {', '.join(KL_PARTS)}")
        self.kl_budget_part = kl_budget_part
        if kl_choices_budget is not None and "kl_choices" not in names:
            names.append("kl_choices")
        self.enabled, self.measures, self.tasks = enabled, names, list(tasks) if tasks is not None else None
        self.level, self.kl_budget, self.kl_choices_budget, self.action = level, kl_budget, kl_choices_budget, action
        self.active = False
        self.planned: int | None = None  # validations after step 0 (None: alpha spending)
        self.looks = 0  # validations compared so far (checkpointed)
        self.initial_path: str | None = None
        self.initial_sha: str | None = None
        self._initial_rows: list[dict] | None = None
        self._tasks_seen: list[str] = []
        self.alarms: list[dict] = []  # every alarm raised (tests, the summary)
        self._alarmed: set[tuple[str, str]] = set()
        self.last: dict | None = None  # {"step", "comparison": {task: {measure: PairedResult}} at 95 %}
        self.stop_checkpoint: str | None = None
        self._off_logged = False
        self._part_missing_logged = False  # said once: kl_budget falls back to forget/kl
        self._unavailable = False  # the initial records could not be read back (a resumed fit): off for the run
        self._pairs = 1  # monitored task-measure pairs (+ forget/kl with a budget)
        self._rule = "Bonferroni"  # the correction in words, for the alarm line

    # ------------------------------------------------------------------------------------------ settings
    def budget(self, measure: str) -> float | None:
        return self.kl_choices_budget if measure == "kl_choices" else None

    def watched(self, measure: str) -> bool:
        """Does ``measure`` take part in the decision (accuracy-type, or drift with a budget)?"""
        return MEASURES[measure].kind == "accuracy" or self.budget(measure) is not None

    def check(self, initial_eval, datamodule, limit_val_batches=1.0) -> bool:
        """Whether the monitor runs, given the initial-evaluation callback (or None) and the datamodule; a
        :class:`ConfigError` naming the field when it was asked for and cannot run, or names an unknown task.
        Called by the CLI before anything is written, and again in :meth:`setup`."""
        tasks = benchmark_tasks(datamodule)
        initial_on = initial_eval is not None and getattr(initial_eval, "enabled", False) and limit_val_batches != 0
        if self.enabled is True and not initial_on:
            raise ConfigError("forgetting.enabled: true compares with the initial evaluation, but initial_eval.enabled "
                              "is false (or validation is off); set initial_eval.enabled true or forgetting.enabled false")
        if self.enabled is True and not tasks:
            raise ConfigError("forgetting.enabled: true needs benchmarks to compare (data.benchmarks is not set); "
                              "configure data.benchmarks or set forgetting.enabled false")
        if self.tasks is not None and tasks:
            unknown = [t for t in self.tasks if t not in tasks]
            if unknown:
                raise ConfigError(f"forgetting.tasks: unknown task {unknown[0]!r}{did_you_mean(unknown[0], tasks)}; "
                                  f"evaluated tasks: {', '.join(tasks)}")
            if not self.tasks:
                raise ConfigError(f"forgetting.tasks: empty; choose from {', '.join(tasks)} (null: all)")
        return self.enabled is not False and initial_on and bool(tasks)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            self.active = False
            return
        from .initial_eval import InitialEvaluationCallback

        initial = callback_of(trainer, InitialEvaluationCallback)
        self.active = self.check(initial, trainer.datamodule, trainer.limit_val_batches)
        if not self.active and self.enabled is None and trainer.is_global_zero and not self._off_logged:
            self._off_logged = True
            log.info("forgetting monitor off: it compares with the initial evaluation, and this fit has %s",
                     "no benchmarks" if not benchmark_tasks(trainer.datamodule) else "none (initial_eval.enabled false)")

    # ----------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        return {"initial_records": self.initial_path, "initial_sha256": self.initial_sha, "looks": self.looks,
                "alarmed": sorted(self._alarmed)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.initial_path = state_dict.get("initial_records")
        self.initial_sha = state_dict.get("initial_sha256")
        self.looks = int(state_dict.get("looks", 0))
        self._alarmed = {tuple(pair) for pair in state_dict.get("alarmed", [])}

    # ------------------------------------------------------------------------------------------ the loop
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.active or trainer.sanity_checking or getattr(trainer.state.fn, "value", trainer.state.fn) != "fit":
            return
        log_dir = trainer.log_dir  # a broadcast: every rank
        if trainer.global_step == 0:
            if trainer.is_global_zero:
                self._keep_initial(trainer, log_dir)
            return
        self.looks += 1
        new = self._compare(trainer, log_dir) if trainer.is_global_zero else []
        stop = trainer.strategy.broadcast(bool(new) and self.action == "stop", src=0)
        if stop:
            self._stop(trainer, log_dir)

    def _keep_initial(self, trainer, log_dir: str | None) -> None:
        path = records_path(log_dir, "val", 0) if log_dir else None
        if path is None or not os.path.exists(path):
            return
        self.initial_path, self.initial_sha = os.path.abspath(path), sha256(path)
        self._initial_rows = read_records(path)
        self._plan(trainer)

    def _plan(self, trainer) -> None:
        tasks = sorted({row["task"] for row in self._initial_rows or []})
        self._tasks_seen = [t for t in tasks if self.tasks is None or t in self.tasks]
        self.planned = planned_validations(trainer)
        watched = [m for m in self.measures if self.watched(m)]
        pairs = len(self._tasks_seen) * len(watched) + (self.kl_budget is not None)
        rule = (f"Bonferroni over {self.planned} planned validations x {pairs} monitored pairs" if self.planned
                else f"alpha spending level / (j (j+1) x {pairs}) at look j (the number of validations is unknown)")
        self._rule = rule
        log.info("forgetting monitor: %s on %s vs the initial model (%s); family-wise false-alarm rate %g: %s; "
                 "action %s", ", ".join(self.measures), ", ".join(self._tasks_seen) or "no task", self.initial_path,
                 self.level, rule, self.action)
        self._pairs = max(1, pairs)

    def _load_initial(self, trainer, log_dir: str | None) -> bool:
        """A resumed fit: the step-0 records named in the checkpoint (or found under the logger root), intact."""
        path = self.initial_path
        if not path or not os.path.exists(path):
            found = initial_records_candidates(trainer, log_dir)
            if self.initial_sha:
                found = [p for p in found if sha256(p) == self.initial_sha]
            if not found:
                where = path or os.path.join("<logger root>", "*", SAMPLES_DIR, INITIAL_FILE)
                log.warning("forgetting monitor off for this run: the initial records %s are missing (no step-0 "
                            "records found under the logger root)", where)
                return False
            path = found[0]
            log.info("forgetting monitor: comparing with %s (the newest step-0 records under the logger root%s)",
                     path, "" if not self.initial_path else f"; {self.initial_path} is gone")
        try:
            digest = sha256(path)
            if self.initial_sha and digest != self.initial_sha:
                raise ValueError(f"its sha256 {digest[:12]} is not the one recorded at step 0 ({self.initial_sha[:12]})")
            rows = read_records(path)
        except (OSError, ValueError) as err:
            log.warning("forgetting monitor off for this run: the initial records %s are unreadable or changed (%s)",
                        path, err)
            return False
        self.initial_path, self.initial_sha, self._initial_rows = os.path.abspath(path), digest, rows
        self._plan(trainer)
        return True

    def _compare(self, trainer, log_dir: str | None) -> list[dict]:
        if self._initial_rows is None:
            # tried once: without them the monitor is off for the run (rank 0 only: every rank still broadcasts)
            if self._unavailable or not self._load_initial(trainer, log_dir):
                self._unavailable = True
                return []
        path = records_path(log_dir, "val", trainer.global_step) if log_dir else None
        if path is None or not os.path.exists(path):
            return []
        rows = [r for r in read_records(path) if r.get("task") in self._tasks_seen]
        initial = [r for r in self._initial_rows if r.get("task") in self._tasks_seen]
        try:
            comparison = compare_records(initial, rows, self.measures, tasks=self._tasks_seen)
        except MeasureError as err:
            log.warning("forgetting monitor off for this run: cannot pair %s with the initial records %s: %s",
                        path, self.initial_path, err)
            self._unavailable = True
            return []
        self.last = {"step": trainer.global_step, "comparison": comparison}
        metrics: dict[str, float] = {}
        for task, results in comparison.items():
            for measure, result in results.items():
                key = f"forget/{task}/{measure}"
                metrics.update({key: result.difference, f"{key}_low": result.low, f"{key}_high": result.high})
        self._log(trainer, metrics)
        return self._decide(trainer, comparison)

    def _decide(self, trainer, comparison) -> list[dict]:
        alpha = look_alpha(self.level, self.looks, self.planned, self._pairs)
        if self.planned and self.looks == self.planned + 1:
            log.warning("forgetting monitor: validation %d is beyond the %d planned; the false-alarm control "
                        "(Bonferroni) covered only the planned ones", self.looks, self.planned)
        candidates = [(task, m, stats.corrected(r, alpha), self.budget(m)) for task, results in comparison.items()
                      for m, r in results.items() if self.watched(m)]
        bounded = self.budgeted_kl(trainer.callback_metrics)
        if self.kl_budget is not None and bounded is not None:
            mean, low, high = bounded
            se = (high - low) / (2 * stats.normal_quantile(stats.CONFIDENCE))
            result = stats.PairedResult(mean, se, low, high, 0, 0, math.nan)
            candidates.append(("held-out text", "kl", stats.corrected(result, alpha), self.kl_budget))
        new = []
        for task, measure, result, budget in candidates:
            alarming = result.low > budget if measure == "kl" else is_alarm(measure, result, budget)
            if (task, measure) in self._alarmed or not alarming:
                continue
            self._alarmed.add((task, measure))
            alarm = {"step": trainer.global_step, "task": task, "measure": measure, "difference": result.difference,
                     "low": result.low, "high": result.high, "level": result.level, "budget": budget}
            self.alarms.append(alarm)
            new.append(alarm)
            log.warning(self.describe(alarm, trainer))
        return new

    def budgeted_metric(self, metrics) -> str:
        """The metric ``kl_budget`` bounds among the logged ``metrics``: the chosen part, else ``forget/kl``."""
        name = KL_PARTS[self.kl_budget_part]
        if name != KL and name not in metrics and KL in metrics:
            if not self._part_missing_logged:
                self._part_missing_logged = True
                log.info("forgetting.kl_budget bounds %s: its parts are off (initial_eval.kl_parts false)", KL)
            return KL
        return name

    def budgeted_kl(self, metrics) -> tuple[float, float, float] | None:
        """(mean, low, high) of :meth:`budgeted_metric` in ``metrics``, or None when it was not logged."""
        names = with_interval(self.budgeted_metric(metrics))
        return tuple(float(metrics[k]) for k in names) if all(k in metrics for k in names) else None

    def describe(self, alarm: dict, trainer=None) -> str:
        """The one alarm line."""
        lr = getattr(getattr(trainer, "lightning_module", None), "hparams", {}).get("lr") if trainer else None
        metrics = trainer.callback_metrics if trainer is not None else {}
        kl_name = self.budgeted_metric(metrics) if metrics else KL_PARTS[self.kl_budget_part]
        name = kl_name if alarm["measure"] == "kl" else f"forget/{alarm['task']}/{alarm['measure']}"
        what = f"{alarm['task']} {alarm['measure']}" if alarm["measure"] != "kl" else f"{kl_name} (held-out text)"
        what += " fell" if alarm["budget"] is None else f" passed its budget {alarm['budget']:g} nats"
        return (f"forgetting: {what} at step {alarm['step']}: {name} {alarm['difference']:+.4f} "
                f"[{alarm['low']:+.4f}, {alarm['high']:+.4f}] ({100 * alarm['level']:.4g} % interval: {self._rule}, "
                f"family-wise false-alarm rate {self.level:g} over the run); {CAUSE}"
                + (f" (model.lr is {lr:g})" if isinstance(lr, (int, float)) else ""))

    def _log(self, trainer, metrics: dict[str, float]) -> None:
        """To the loggers at the step Lightning logged this validation's metrics at, and to callback_metrics."""
        if not metrics:
            return
        step = validation_log_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            logger.save()
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})

    def _stop(self, trainer, log_dir: str | None) -> None:
        path, command = stop_with_checkpoint(trainer, log_dir, STOP_FILE.format(step=trainer.global_step))
        self.stop_checkpoint = path
        if trainer.is_global_zero:
            message = (f"forgetting: stopping at step {trainer.global_step} (forgetting.action=stop); checkpoint "
                       f"{path}. Resume with: {command} "
                       "(with a lower --model.lr, or --forgetting.action warn to go on as before)")
            log.warning(message)
            print(message, flush=True)
