"""RunSummaryCallback: what a finished fit measured, where it wrote, and what to run next, in one block.

A run otherwise ends in pages of Lightning output, with the numbers that matter spread over metrics.csv,
saturation_summary.json and the config. At the end of fit, on global rank 0, this prints (stdout) and saves
(``run_summary.txt`` in the log directory):
  train loss (last step); val loss and perplexity;
  per benchmark task acc and acc_norm with lm-eval's standard error sqrt(p (1 - p) / (n - 1)), and n, the examples
  scored, against the examples selected;
  forgetting: per benchmark, initial -> final for acc, acc_norm and the monitored continuous measure
  (ForgettingMonitor's; default p_gold_norm), paired over the same examples, with the difference, its 95 %
  interval and the verdict, and ``forget/kl`` (KL(initial || final) on held-out text) with its parts (drift:
  training; quantization: HiF8) when logged, the W8A8 ones read against the noise floor;
  the noise floor (``callbacks.noise_floor``: KL, perplexity ratios, benchmark answers changed, its time);
  saturation totals (from AmaxSaturationCallback's summary file, or its ``summary()`` if it has none yet), and
  the fallback policy's decisions grouped by symptom and remedy, with their verification and the budget's stop
  (``qat_app.hif8.fallback_summary``: at most 6 lines);
  the log and checkpoint locations; the report and export commands for this run.
"""

from __future__ import annotations

import json
import logging
import math
import os

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from qat_app.eval.measures import MeasureError, compare_records, verdict
from qat_app.eval.records import FORGET_GENERATION_KL, read_records, recorded_steps, records_path

from qat_app import stats
from qat_app.distill.config import DISTILL_CE, DISTILL_KL
from qat_app.eval.kl_cache import DRIFT, KL, QUANTIZATION, with_interval
from qat_app.hif8.fallback_summary import summary_lines as fallback_lines
from qat_app.hif8.forecast import summary_lines as forecast_lines
from qat_app.hif8.headroom import summary_lines as headroom_lines

from .forgetting import DEFAULT_MEASURES, ForgettingMonitor, initial_records_candidates
from .noise_floor import NoiseFloorCallback
from .per_step import callback_of
from .saturation import AmaxSaturationCallback

log = logging.getLogger(__name__)


def stderr(p: float, n: float) -> float:
    """lm-eval's sample standard error of a mean accuracy over n examples (nan for n < 2)."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def summary_measures(monitor: ForgettingMonitor | None) -> list[str]:
    """acc, acc_norm and the monitor's other measures (its continuous ones; p_gold_norm without a monitor)."""
    others = [m for m in (monitor.measures if monitor is not None else DEFAULT_MEASURES) if m not in ("acc", "acc_norm")]
    return ["acc", "acc_norm", *others]


def final_step(log_dir: str | None) -> int | None:
    """The step of this fit's last validation records (the highest step > 0 in ``log_dir``)."""
    steps = [s for s in recorded_steps(log_dir) if s > 0] if log_dir else []
    return steps[-1] if steps else None


def forgetting_lines(trainer: L.Trainer, log_dir: str | None, metrics: dict[str, float]) -> list[str]:
    """The forgetting block: initial -> final per task and measure (95 % paired interval, verdict), forget/kl."""
    monitor = callback_of(trainer, ForgettingMonitor)
    initial = monitor.initial_path if monitor is not None and monitor.initial_path else None
    if not initial or not os.path.exists(initial):
        here = records_path(log_dir, "val", 0) if log_dir else None
        found = [here] if here and os.path.exists(here) else initial_records_candidates(trainer, log_dir)
        initial = found[0] if found else None
    step = final_step(log_dir)
    final = records_path(log_dir, "val", step) if step is not None else None
    lines = []
    if initial and final:
        measures = summary_measures(monitor)
        try:
            comparison = compare_records(read_records(initial), read_records(final), measures)
        except (OSError, ValueError, MeasureError) as err:
            comparison = None
            lines.append(f"forgetting    - (cannot compare {_show(final)} with {_show(initial)}: {err})")
        if comparison is not None:
            lines.append(f"forgetting    initial -> final (step {step}), paired over the same examples; "
                         "difference [95 % interval], verdict")
            for task, results in comparison.items():
                for i, measure in enumerate(m for m in measures if m in results):
                    r = results[measure]
                    budget = monitor.budget(measure) if monitor is not None else None
                    values = f"{r.before:.4f} -> {r.after:.4f}" if r.before is not None else "(drift)"
                    lines.append(f"  {task if i == 0 else '':<13} {measure:<12} {values:<18} {r.difference:+.4f} "
                                 f"[{r.low:+.4f}, {r.high:+.4f}]  {verdict(measure, r, budget)}   n={r.n}")
                for measure, why in comparison.unavailable.get(task, {}).items():
                    lines.append(f"  {'':<13} {measure:<12} - ({why})")
    lines += kl_lines(metrics, monitor, _floor_callback(trainer))
    if monitor is not None and monitor.alarms:
        first = monitor.alarms[0]
        lines.append(f"  alarms        {len(monitor.alarms)}; first at step {first['step']}: {first['task']} "
                     f"{first['measure']}" + (f" (stopped: {_show(monitor.stop_checkpoint)})" if monitor.stop_checkpoint else ""))
    return lines


KL_LINES = ((KL, "KL(initial || final) on held-out text"),
            (DRIFT, "of which training: KL(initial || final, quantization off)"),
            (QUANTIZATION, "of which HiF8: KL(final off || final on), full vocabulary"),
            (FORGET_GENERATION_KL, "KL(initial || final) along the initial model's greedy continuations, full vocabulary"))


def _floor_callback(trainer: L.Trainer) -> NoiseFloorCallback | None:
    return callback_of(trainer, NoiseFloorCallback)


def kl_lines(metrics: dict[str, float], monitor: ForgettingMonitor | None, floor: NoiseFloorCallback | None) -> list[str]:
    """``forget/kl`` and its parts with their intervals; the budget on the part it bounds; the W8A8 ones (the
    total and the quantization part: the drift compares unquantized forwards) read against the noise floor."""
    lines = []
    budget = monitor.kl_budget if monitor is not None else None
    bounded = monitor.budgeted_metric(metrics) if monitor is not None else None
    measured = floor.floor if floor is not None and floor.floor is not None and floor.floor.quantized else None
    floor_high = measured.kl.high if measured is not None else None
    for name, what in KL_LINES:
        values = [metrics.get(k) for k in with_interval(name)]
        if values[0] is None:
            continue
        bounds = f" [{values[1]:.4f}, {values[2]:.4f}]" if None not in values else ""
        words = ""
        if budget is not None and name == bounded:
            words += (" over budget" if (values[1] if values[1] is not None else -1) > budget else " within budget") + f" {budget:g}"
        if measured is not None and name != DRIFT and None not in values:
            words += f"; {stats.floor_verdict(values[1], values[2], floor_high)}"
        lines.append(f"  {name:<28} {values[0]:.4f} nats/token{bounds}{words} ({what})")
    return lines


def profile_lines(trainer: L.Trainer) -> list[str]:
    """The step profile's table (``--profile.steps N``), when the fit recorded one."""
    from qat_app.step_profile import StepProfiler

    profiler = trainer.profiler
    if not isinstance(profiler, StepProfiler) or profiler.result is None:
        return []
    return ["profile       " + line if k == 0 else "              " + line
            for k, line in enumerate(profiler.result.table().splitlines())]


def floor_lines(floor: NoiseFloorCallback | None) -> list[str]:
    """The noise floor measured at the end of the fit, with its time."""
    if floor is None or floor.floor is None:
        return []
    f = floor.floor
    if not f.quantized:
        return [f"noise floor   0 ({f.note})"]
    lines = [f"noise floor   KL {f.kl.difference:.5f} [{f.kl.low:.5f}, {f.kl.high:.5f}] nats/token over {f.kl.n_clusters} "
             f"held-out sequences (the model against itself, inputs x (1 + {f.relative:g} N(0,1)), seeds "
             f"{', '.join(map(str, f.seeds))}; {floor.seconds:.0f} s)",
             f"              perplexity ratio per seed {f.ratios_text()}"]
    if floor.flips is not None:
        lines.append(f"              benchmark answers (acc_norm) changed {floor.flips.changed_text()}")
    return lines


def interval_lines(trainer: L.Trainer) -> list[str]:
    """The validation and checkpoint intervals in optimizer steps (``val_check_interval`` counts micro-batches)."""
    parts = []
    interval, accumulate = trainer.val_check_interval, max(1, int(trainer.accumulate_grad_batches or 1))
    if isinstance(interval, int) and not isinstance(interval, bool):
        parts.append(f"validation every {interval / accumulate:g} optimizer steps (val_check_interval {interval} "
                     f"micro-batches / {accumulate} per step)")
    checkpoint = callback_of(trainer, ModelCheckpoint)
    every = getattr(checkpoint, "_every_n_train_steps", 0) if checkpoint is not None else 0
    if every:
        parts.append(f"checkpoints every {every} optimizer steps")
    return [f"intervals     {'; '.join(parts)}"] if parts else []


def _show(path: str | None) -> str:
    """A path relative to the working directory when it is inside it (shorter, and what the user typed)."""
    if not path:
        return "-"
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


class RunSummaryCallback(L.Callback):
    """The end-of-fit summary (also saved as a file).

    Args:
        enabled: print and save the summary at the end of fit.
        baseline: the matched BF16 baseline run directory, filled into the printed report command.
        export_dir: where the printed export command writes (``<export_dir>/<run name>``).
        file_name: name of the copy saved in the log directory (None: not saved).
    """

    def __init__(self, enabled: bool = True, baseline: str | None = None, export_dir: str = "exports",
                 file_name: str | None = "run_summary.txt") -> None:
        self.enabled, self.baseline, self.export_dir, self.file_name = enabled, baseline, export_dir, file_name
        self.text: str | None = None  # the last summary (tests, programmatic use)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled:
            return
        log_dir = trainer.log_dir  # a collective (broadcast): on every rank
        sat, sat_file = self.saturation(trainer, pl_module)  # may be a collective too
        if not trainer.is_global_zero:
            return
        self.text = self.render(trainer, log_dir, sat, sat_file)
        print(self.text, flush=True)
        if self.file_name and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, self.file_name)
            with open(path, "w") as f:
                f.write(self.text + "\n")
            log.info("run summary saved to %s", path)

    def saturation(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[dict | None, str | None]:
        """The saturation totals (on rank 0) and the file they came from.

        AmaxSaturationCallback writes its file in its own ``on_fit_end`` (rank 0): read it when that hook ran
        before this one (the CLI adds it first), else compute the same totals with its ``summary()``, a
        collective, so the choice depends only on the callback order, the same on every rank."""
        order = list(trainer.callbacks)
        sat = next((c for c in order if isinstance(c, AmaxSaturationCallback)), None)
        if sat is None:
            return None, None
        if sat.summary_file and order.index(sat) < next(i for i, c in enumerate(order) if c is self):
            if not (trainer.is_global_zero and sat.summary_path and os.path.exists(sat.summary_path)):
                return None, None
            with open(sat.summary_path) as f:
                return json.load(f), sat.summary_path
        return sat.summary(pl_module), None

    def render(self, trainer: L.Trainer, log_dir: str | None, sat: dict | None, sat_file: str | None) -> str:
        m = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        unquantized = sat is not None and not sat.get("quantized_tensors")
        lines = [f"=== run summary: {trainer.global_step} of {trainer.max_steps} optimizer steps ===",
                 *interval_lines(trainer), *_metric_lines(m), *forgetting_lines(trainer, log_dir, m),
                 *floor_lines(_floor_callback(trainer)), *_saturation_lines(sat, sat_file, unquantized),
                 *profile_lines(trainer), f"logs          {_show(log_dir)}"]
        checkpoint = callback_of(trainer, ModelCheckpoint)
        last = None
        if checkpoint is not None:
            last = checkpoint.last_model_path or checkpoint.best_model_path or None
            lines.append(f"checkpoints   {_show(checkpoint.dirpath)}" + (f" (last: {_show(last)})" if last else ""))
        else:
            lines.append("checkpoints   - (no ModelCheckpoint configured)")
        return "\n".join(lines + self._next_lines(trainer, log_dir, last, unquantized))

    def _next_lines(self, trainer: L.Trainer, log_dir: str | None, last: str | None, unquantized: bool) -> list[str]:
        """The commands that come next: the report, the exports, vLLM."""
        root = trainer.default_root_dir
        run_dir = root if log_dir and os.path.abspath(log_dir).startswith(os.path.abspath(root) + os.sep) else log_dir
        run_dir = _show(run_dir)
        if unquantized:
            return ["next:", f"  report      python main.py report --baseline {run_dir} --qat <QAT run>"]
        lines = ["next:", f"  report      python main.py report --baseline {self.baseline or '<bf16 baseline run>'} "
                          f"--qat {run_dir}"]
        name = os.path.basename(os.path.normpath(run_dir)) if run_dir != "-" else "run"
        export = f"python main.py export --ckpt_path {_show(last) if last else '<checkpoint>'} " \
                 f"--out {os.path.join(self.export_dir, name)}"
        config = os.path.join(log_dir, "config.yaml") if log_dir else None
        compare = f" --compare --config {_show(config)}" if config and os.path.isfile(config) else ""
        lines.append(f"  export      {export}")
        lines.append(f"  serve       {export}-fp8 --format compressed-tensors{compare}")
        if compare:  # the same export served by vLLM itself, measured against this run
            lines.append(f"  on vLLM     python benchmarks/serve_vllm.py --ckpt_path {_show(last) if last else '<checkpoint>'} "
                         f"--config {_show(config)} --out {os.path.join(self.export_dir, name)}-fp8")
        return lines


def _metric_lines(m: dict[str, float]) -> list[str]:
    """The last step's losses, the validation loss and each benchmark's scores."""
    lines = []
    if "train/loss" in m:
        lines.append(f"train loss    {m['train/loss']:.4f} (last step)")
    if DISTILL_KL in m:
        lines.append(f"distillation  KL(teacher || student) {m[DISTILL_KL]:.4f}, CE {m.get(DISTILL_CE, math.nan):.4f} "
                     "nats/token (last step)")
    if "val/loss" in m:
        ppl = f"   perplexity {m['val/ppl']:.2f}" if "val/ppl" in m else ""
        lines.append(f"val loss      {m['val/loss']:.4f}{ppl}")
    else:
        lines.append("val loss      - (no validation ran)")
    for key in sorted(k for k in m if k.startswith("val/") and k.endswith("/count")):
        task, n = key[len("val/"):-len("/count")], m[key]
        scores = [f"{name} {m[f'val/{task}/{name}']:.4f} +- {stderr(m[f'val/{task}/{name}'], n):.4f}"
                  for name in ("acc", "acc_norm") if f"val/{task}/{name}" in m]
        selected = m.get(f"val/{task}/selected")
        scored = f"n={int(n)}" if selected is None else f"n={int(n)}/{int(selected)}"  # scored / selected
        if selected is not None and n < selected:
            scored += f" (only {int(n)} of the {int(selected)} selected examples scored)"
        lines.append(f"{task:<13} {'   '.join(scores)}   {scored}")
    return lines


def _saturation_lines(sat: dict | None, sat_file: str | None, unquantized: bool) -> list[str]:
    """The run's clipping, headroom, forecast and fallback totals."""
    if not sat or unquantized:
        return ["saturation    - " + ("(no quantized layers: an unquantized run)" if unquantized else "(no totals)")]
    lines = [f"saturation    {sat['clipped']} of {sat['seen']:.3g} quantized elements clipped "
             f"({sat['clipped_frac']:.1e}), {sat['saturation_events']} saturation events"
             + (f" [{_show(sat_file)}]" if sat_file else "")]
    if sat.get("min_headroom") is not None:
        first = sat.get("first_clipped_step")
        lines.append(f"              min headroom (a_hat / amax) {sat['min_headroom']:.3f}; "
                     + (f"first clipped at step {first}" if first is not None else "nothing clipped"))
    lines += headroom_lines(sat.get("headroom")) + forecast_lines(sat.get("forecast"))
    return lines + fallback_lines(sat.get("fallback") or [], sat.get("fallback_stopped"))
