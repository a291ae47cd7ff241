"""Where a W8A8 step's time goes: a few optimizer steps under ``torch.profiler``, sorted into the categories a user
reasons in (:class:`StepProfiler`, ``python main.py fit --profile.steps N``).

It records ``steps`` whole optimizer steps, by default after the first logging step past the warmup's switch
(where kernels compile), and gives each op's time to the innermost range it ran in, one of :data:`CATEGORIES`
(self CPU time; on CUDA also its kernels' GPU time). The quantization overhead is estimated as (quantize + scaler
update + health and what-if) over the rest. The digest goes to the log, ``<log_dir>/profile.json``, every logger
(``profile/*``) and TensorBoard. Contract: each op's time is counted once, in one category; with ``steps=0``
(the default) nothing is recorded.

See ``docs/dashboard.md`` ("Where the time goes") for the categories and the output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from lightning.pytorch.profilers import Profiler
from torch.autograd.profiler import record_function

from qat_app.eval.records import PROFILE_FILE
from qat_app.hif8 import profiling

log = logging.getLogger(__name__)

QUANTIZE, GEMM, SCALER, HEALTH = "quantize", "gemm", "scaler update", "health and what-if"
OPTIMIZER, DATA, EVALUATION, COMMUNICATION = "optimizer", "data", "evaluation", "communication"
OTHER, CALLBACKS, CHECKPOINT, FRAMEWORK = "other compute", "callbacks and logging", "checkpointing", "framework"
CATEGORIES = (QUANTIZE, GEMM, SCALER, HEALTH, OPTIMIZER, DATA, EVALUATION, COMMUNICATION, OTHER, CALLBACKS,
              CHECKPOINT, FRAMEWORK)
UNRANGED = "not in a range"
QUANTIZATION_CATEGORIES = (QUANTIZE, SCALER, HEALTH)  # what a BF16 step does not do

_RANGE_CATEGORY = {profiling.QUANTIZE: QUANTIZE, profiling.GEMM: GEMM, profiling.SCALER_UPDATE: SCALER,
                   profiling.HEALTH: HEALTH, profiling.WHATIF: HEALTH,
                   "QuantizedMatmulFunction": QUANTIZE, "QuantizedMatmulFunctionBackward": QUANTIZE}
_COMMUNICATION = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|barrier|c10d::|nccl|gloo",
                            re.IGNORECASE)
_MATMUL = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|_addmm_activation)$")
_OP_PREFIXES = ("aten::", "prim::", "inductor::", "triton", "## Call CompiledFxGraph", "cuda", "Memcpy", "Memset")
PL_PREFIX = "[pl]"  # the ranges this profiler opens for Lightning's actions


def _lightning_category(action: str) -> str | None:
    """The category of one of Lightning's profiled actions (None: a container, e.g. the training step)."""
    if "dataloader_next" in action or "batch_to_device" in action:
        return DATA
    if "validation" in action or "val_next" in action or "run_validation" in action:
        return EVALUATION
    if "optimizer_zero_grad" in action or "clip_gradients" in action or "configure_gradient_clipping" in action:
        return OPTIMIZER
    if "save_checkpoint" in action or "state_dict" in action:
        return CHECKPOINT
    if action.startswith("[Callback]"):
        return CALLBACKS
    if "training_step" in action or "backward" in action:
        return CONTAINER  # Lightning runs them inside Optimizer.step's closure: not the optimizer's
    return None


CONTAINER = ""  # the training step and backward: what runs inside them is sorted by itself, not by Optimizer.step


def range_category(name: str) -> str | None:
    """The category a range (or op) named ``name`` puts its own time and its children's in; :data:`CONTAINER`: a
    Lightning action that holds other work (the training step, backward: Lightning runs them inside
    ``Optimizer.step``'s closure, and they are not the optimizer's); None: not a range that sorts."""
    if name in _RANGE_CATEGORY:
        return _RANGE_CATEGORY[name]
    if _COMMUNICATION.search(name):
        return COMMUNICATION
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return OPTIMIZER
    if name.startswith(PL_PREFIX):
        return _lightning_category(name[len(PL_PREFIX):])
    return None


def _own_category(name: str) -> str:
    """The category of an op outside every categorized range."""
    if _MATMUL.match(name):
        return GEMM
    return OTHER if name.startswith(_OP_PREFIXES) else FRAMEWORK


def categorize(events) -> tuple[dict[str, float], dict[str, float]]:
    """-> (CPU self seconds, device self seconds) per category of :data:`CATEGORIES`, from ``torch.profiler``'s
    ``FunctionEvent`` list: each event's self time goes to the innermost categorized range around it (itself
    included; a collective is communication wherever it runs), else to what the op is."""
    context: dict[int, str | None] = {}

    def enclosing(event) -> str | None:
        key = id(event)
        if key not in context:
            own = range_category(event.name)
            parent = event.cpu_parent
            context[key] = own if own is not None or parent is None else enclosing(parent)
        return context[key]

    cpu = dict.fromkeys(CATEGORIES, 0.0)
    device = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        category = (COMMUNICATION if _COMMUNICATION.search(event.name) else None) or enclosing(event) \
            or _own_category(event.name)  # (a container's "" is falsy: the op's own category)
        cpu[category] += event.self_cpu_time_total / 1e6
        device[category] += getattr(event, "self_device_time_total", 0.0) / 1e6
    return cpu, device


@dataclass
class StepProfile:
    """The digest of ``steps`` profiled optimizer steps (seconds per step)."""

    steps: int
    first_step: int
    device_type: str
    wall_s: float  # the window's wall time per step
    cpu_s: dict[str, float]  # per category
    device_s: dict[str, float] = field(default_factory=dict)  # CUDA: GPU time per category

    @property
    def in_ranges_s(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def unranged_s(self) -> float:
        return self.wall_s - self.in_ranges_s

    def overhead(self, times: dict[str, float], total: float) -> float:
        """Quantization's time over the rest of the step: the cost of a W8A8 step against a BF16 one, estimated."""
        quantization = sum(times[c] for c in QUANTIZATION_CATEGORIES)
        rest = total - quantization
        return quantization / rest if rest > 0 else float("nan")

    @property
    def cpu_overhead(self) -> float:
        return self.overhead(self.cpu_s, self.wall_s)

    def to_dict(self) -> dict:
        return asdict(self) | {"unranged_s": self.unranged_s, "cpu_overhead": self.cpu_overhead}

    @classmethod
    def from_dict(cls, data: dict) -> "StepProfile":
        return cls(**{k: data[k] for k in ("steps", "first_step", "device_type", "wall_s", "cpu_s")},
                   device_s=data.get("device_s") or {})

    def table(self) -> str:
        """The digest as a text table: per category its time per step and share, CPU (and GPU on CUDA)."""
        gpu = any(self.device_s.values())
        busy = sum(self.device_s.values())
        head = f"{'category':<24}{'CPU s/step':>11}{'share':>8}" + (f"{'GPU s/step':>12}{'share':>8}" if gpu else "")
        lines = [f"Step profile: {self.steps} optimizer step(s) from step {self.first_step} on {self.device_type}, "
                 f"{self.wall_s:.3f} s per step (wall)", head]
        for category in CATEGORIES:
            cpu = self.cpu_s[category]
            if cpu == 0 and not self.device_s.get(category):
                continue
            row = f"{category:<24}{cpu:>11.3f}{cpu / self.wall_s:>8.1%}"
            if gpu:
                dev = self.device_s.get(category, 0.0)
                row += f"{dev:>12.4f}{dev / busy:>8.1%}"
            lines.append(row)
        lines.append(f"{UNRANGED:<24}{self.unranged_s:>11.3f}{self.unranged_s / self.wall_s:>8.1%}")
        lines.append(f"quantization overhead vs a BF16 step (quantize + scaler update + health and what-if over the "
                     f"rest, estimated): CPU {self.cpu_overhead:+.1%}"
                     + (f", GPU {self.overhead(self.device_s, busy):+.1%}" if gpu else ""))
        return "\n".join(lines)


class StepProfiler(Profiler):
    """Lightning's profiler interface over ``torch.profiler`` for ``steps`` optimizer steps (see the module
    docstring). ``steps=0`` (the default) records nothing and costs nothing.

    Args:
        steps: optimizer steps to record (0: off).
        start_step: the first recorded step (global step); default: ``warmup.warmup_steps +
            trainer.log_every_n_steps + 1``, past every first-time compilation (no later than ``max_steps - steps``).
        trace: also write the Chrome trace (``profile_trace.json`` beside ``profile.json``).
    """

    def __init__(self, steps: int = 0, start_step: Optional[int] = None, trace: bool = False) -> None:
        super().__init__()
        self._torch_profiler = None
        if steps < 0:
            from qat_app.errors import ConfigError

            raise ConfigError(f"profile.steps: must be >= 0 (0 is off), got {steps}")
        self.steps, self.start_step, self.trace = steps, start_step, trace
        self.result: StepProfile | None = None
        self._ranges: dict[str, record_function] = {}
        self._first_step = None
        self._last_fetch_step = None
        self._window_start = 0.0

    # -------------------------------------------------------------------------------- Lightning's interface
    def start(self, action_name: str) -> None:
        if not self.steps or self.result is not None:
            return
        if "train_dataloader_next" in action_name:
            self._at_fetch()
        if self._torch_profiler is not None and action_name not in self._ranges:
            recording = record_function(PL_PREFIX + action_name)
            recording.__enter__()
            self._ranges[action_name] = recording

    def stop(self, action_name: str) -> None:
        recording = self._ranges.pop(action_name, None)
        if recording is not None:
            recording.__exit__(None, None, None)
        if action_name == "run_training_epoch" and self._torch_profiler is not None:
            self._finish()  # the fit ended inside the window

    def summary(self) -> str:
        return self.result.table() if self.result is not None else ""

    def teardown(self, stage: Optional[str]) -> None:
        if self._torch_profiler is not None:
            self._finish()
        super().teardown(stage)

    # ------------------------------------------------------------------------------------------ the window
    def _trainer(self):
        module = getattr(self, "_lightning_module", None)
        return None if module is None else module.trainer

    def _default_start(self, trainer) -> int:
        from callbacks.warmup import BF16WarmupCallback

        warmup = next((c for c in trainer.callbacks if isinstance(c, BF16WarmupCallback)), None)
        switch = warmup.warmup_steps if warmup is not None else 0
        # after the switch (the quantize kernels compile) and the first logging step after it (the health ones)
        start = switch + trainer.log_every_n_steps + 1
        if trainer.max_steps and trainer.max_steps > 0 and start + self.steps > trainer.max_steps:
            start = max(trainer.max_steps - self.steps, 0)
        return start

    def _at_fetch(self) -> None:
        """A data fetch: the first one of an optimizer step opens or closes the window."""
        trainer = self._trainer()
        if trainer is None or trainer.state.fn != "fit":
            return
        step = trainer.global_step
        if step == self._last_fetch_step:
            return  # a later micro-batch of the same step
        self._last_fetch_step = step
        if self._torch_profiler is None:
            start = self.start_step if self.start_step is not None else self._default_start(trainer)
            if step == start:
                self._begin(step)
        elif step >= self._first_step + self.steps:
            self._finish()

    def _synchronize(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _begin(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._torch_profiler = torch.profiler.profile(activities=activities)
        self._synchronize()
        self._torch_profiler.__enter__()
        self._first_step = step
        self._window_start = time.perf_counter()

    def _finish(self) -> None:
        self._synchronize()
        wall = time.perf_counter() - self._window_start
        for recording in self._ranges.values():  # ranges still open (the step that closes the window)
            recording.__exit__(None, None, None)
        self._ranges.clear()
        prof, self._torch_profiler = self._torch_profiler, None
        prof.__exit__(None, None, None)
        trainer = self._trainer()
        done = (trainer.global_step if trainer is not None else self._first_step + self.steps) - self._first_step
        done = max(done, 1)
        cpu, device = categorize(prof.events())
        device_type = "cuda" if any(device.values()) else "cpu"
        self.result = StepProfile(done, self._first_step, device_type, wall / done,
                                  {k: v / done for k, v in cpu.items()},
                                  {k: v / done for k, v in device.items()} if device_type == "cuda" else {})
        self._publish(trainer, prof)

    def _publish(self, trainer, prof) -> None:
        """profile.json (and the trace) in the log directory, ``profile/*`` to the loggers, the table to the log."""
        log.info("%s", self.result.table())
        if trainer is None or not trainer.is_global_zero:
            return
        log_dir = trainer.log_dir or self.dirpath
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, PROFILE_FILE), "w") as f:
                json.dump(self.result.to_dict(), f, indent=1)
            if self.trace:
                prof.export_chrome_trace(os.path.join(log_dir, "profile_trace.json"))
        metrics = {f"profile/{c.replace(' ', '_')}_s": v for c, v in self.result.cpu_s.items()}
        metrics |= {"profile/step_s": self.result.wall_s, "profile/quantization_overhead": self.result.cpu_overhead}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("profile", "<pre>" + self.result.table() + "</pre>", trainer.global_step)
