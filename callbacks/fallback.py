"""FallbackCallback: the automatic fallback policy of :mod:`qat_app.hif8.fallback` in a fit (opt-in).

The policy runs in the core's per-step protocol: this callback hands its
:class:`~qat_app.hif8.fallback.FallbackMonitor` to the LightningModule (``run_fallback_policy``), and
:func:`~qat_app.hif8.training.sync_and_advance` decides on the step's record (two run counters per quantized tensor
and, on the steps whose health the saturation callback measured, their SQNR, summed over the ranks): it updates
the evidence and makes the tensors that qualify fall back to ``policy.target`` before the next forward. Once per
optimizer step this callback reports the record's decisions. Each decision is one warning with its evidence and is logged as ``fallback/tensors`` (the count so far, every step). The decisions live in the
quantized matmuls' extra state (checkpoints, exports, the saturation summary and the report list them), and
the evidence in this callback's ``state_dict``, so a run resumed from any checkpoint takes the decisions an
uninterrupted one takes, at the same steps.

Configured as the ``fallback`` section: ``--fallback.enabled true --fallback.policy.target high_precision``.
"""

from __future__ import annotations

import logging

import lightning as L

from qat_app.errors import ConfigError, settings_of
from qat_app.hif8.errors import FieldError
from qat_app.hif8.fallback import (FallbackMonitor, FallbackPolicy, check_reachable_floor, quantized_tensors,
                                   read_counters, scaler_pairs)
from qat_app.hif8.fallback_targets import TARGET_TEXT

from .per_step import PerOptimizerStep, callback_of
from .saturation import AmaxSaturationCallback, step_record_of
from .warmup import BF16WarmupCallback

log = logging.getLogger(__name__)

FALLBACK_METRIC = "fallback/tensors"
POLICY = "fallback.policy"  # where the policy's settings live on the command line


def check_fallback(policy: FallbackPolicy, *, warmup_steps: int, max_steps: int, health: bool, recipe=None) -> None:
    """Raise :class:`ConfigError` when the window is longer than the run's quantized steps (it could never fill),
    the SQNR rule is asked for without the SQNR being measured (``health``: the saturation callback's), or its
    floor is above what the recipe's format can give (:func:`~qat_app.hif8.fallback.check_reachable_floor`)."""
    quantized_steps = max_steps - warmup_steps
    if max_steps > 0 and policy.window > quantized_steps:
        raise ConfigError(f"fallback.policy.window ({policy.window}) is longer than the run's {quantized_steps} quantized "
                          f"steps (trainer.max_steps {max_steps} - warmup.warmup_steps {warmup_steps}): it could "
                          "never fill; use a shorter window")
    if policy.sqnr_floor_db is not None and not health:
        raise ConfigError("fallback.policy.sqnr_floor_db needs the SQNR measured: set saturation.health true "
                          "(it is measured every trainer.log_every_n_steps)")
    if recipe is not None:
        with settings_of(POLICY):
            check_reachable_floor(policy, recipe.format, recipe.resolved_max_val)


def make_policy(policy) -> FallbackPolicy:
    """The core's policy from what the command line gave (a policy, or a dict), its errors named ``fallback.policy.*``."""
    if isinstance(policy, FallbackPolicy):
        return policy
    try:
        with settings_of(POLICY):
            return FallbackPolicy(**(policy.as_dict() if hasattr(policy, "as_dict") else dict(policy or {})))
    except TypeError as err:  # an unknown key of a dict
        raise ConfigError(f"{POLICY}: {err}") from None


class FallbackCallback(PerOptimizerStep):
    """The automatic fallback of persistently saturating or low-SQNR tensors (opt-in).

    Args:
        enabled: apply the fallback policy (off by default: a tensor only falls back when asked to).
        policy: when a tensor falls back and to what (:class:`qat_app.hif8.fallback.FallbackPolicy`).
    """

    def __init__(self, enabled: bool = False, policy: FallbackPolicy = FallbackPolicy()) -> None:
        self.enabled = enabled
        self.policy = make_policy(policy)
        self.monitor: FallbackMonitor | None = None
        self._saved: dict | None = None  # the checkpoint's evidence, until the model's tensors are known
        self.decisions: list[dict] = []  # this fit's, in order
        self._fallen_back = 0  # tensors fallen back so far, resumed ones included (the logged count)
        self._said_stop = False  # the budget's stop is said once (a resumed run whose policy stopped: at resume)

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.state_dict() if self.monitor is not None else self._saved}

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved = state_dict.get("monitor")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check(trainer, pl_module)

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The policy against the run (:func:`check_fallback`); the CLI calls it before the trainer writes anything."""
        if not self.enabled:
            return
        saturation = callback_of(trainer, AmaxSaturationCallback)
        warmup = callback_of(trainer, BF16WarmupCallback)
        quant = getattr(pl_module, "quant", None)
        check_fallback(self.policy, warmup_steps=warmup.warmup_steps if warmup is not None else 0,
                       max_steps=trainer.max_steps or -1, health=saturation is not None and saturation.health,
                       recipe=getattr(quant, "recipe", None) if getattr(quant, "enabled", True) else None)
        model = getattr(pl_module, "model", None)
        tensors = quantized_tensors(model) if model is not None else []
        if tensors:
            with settings_of(POLICY):  # a budget above the model's quantized tensors, named before anything is written
                self.policy.budget(len(tensors))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if not self.enabled:
            return
        tensors = quantized_tensors(pl_module.model)
        if not tensors:
            log.warning("fallback: the model has no quantized tensor (quant.enabled=false?); nothing can fall back")
            return
        if not hasattr(pl_module, "run_fallback_policy"):
            raise ConfigError(f"fallback.enabled: {type(pl_module).__name__} does not run the fallback policy in its "
                              "optimizer step (qat_app.module.QATModule does)")
        self.monitor = FallbackMonitor.for_model(self.policy, pl_module.model)  # its budget: checked at setup
        self._fallen_back = sum(operand in layer.fallback for _, layer, operand in tensors)
        if self._saved is not None:
            try:
                self.monitor.load_state_dict(self._saved)
            except FieldError as err:
                raise ConfigError(f"fallback: the checkpoint's fallback state does not fit this model: {err}") from None
        else:  # a fresh run (zeros), or one resumed from a checkpoint without fallback state: evidence starts now
            counters = read_counters(scaler_pairs(tensors), health=False)
            self.monitor.start(counters.events, counters.steps)
        pl_module.run_fallback_policy(self.monitor)  # decided on in the module's optimizer step, from now on

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.monitor is None:
            return
        step = self.completed_step(trainer)
        if step is None:
            return
        record = step_record_of(pl_module, step)
        new = list(record.fallback) if record is not None else []  # decided on the step's counters
        for decision in new:
            log.warning("fallback at step %d: %s.%s -> %s for the rest of the run (%s: %s)", decision["step"],
                        decision["module"], decision["operand"], TARGET_TEXT[decision["target"]], decision["reason"],
                        decision["evidence"])
        for done in self.monitor.verified:
            verdict = done["verified"]
            (log.info if verdict["worked"] else log.warning)(
                "fallback verified at step %d: %s.%s -> %s %s: %s", verdict["step"], done["module"], done["operand"],
                TARGET_TEXT[done["target"]], "worked" if verdict["worked"] else "DID NOT WORK", verdict["text"])
        stopped = self.monitor.stopped
        if stopped is not None and not self._said_stop:
            self._said_stop = True
            log.warning("fallback stopped at step %d: %d tensors qualified at once (%d fell back before; budget %d, "
                        "fallback.policy.max_tensors): the recipe, not a few tensors, is the problem: %s",
                        stopped["step"], stopped["qualified"], stopped["already"], stopped["budget"], stopped["diagnosis"])
        self.decisions.extend(new)
        self._fallen_back += len(new)
        self.log_at(trainer, {FALLBACK_METRIC: float(self._fallen_back)}, step)
