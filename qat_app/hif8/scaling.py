"""Delayed tensor scaling: a per-tensor amax history and the a_hat estimators of the paper (:class:`AmaxScaler`).

``observe`` sees every forward of the tensor and ``advance`` runs once per optimizer step, so ``history_len``
counts optimizer steps whatever the gradient accumulation. ``a_hat(t)`` comes from earlier steps: ``most_recent``
``amax(t-1)``, ``exp_smooth`` ``alpha * amax(t-1) + (1 - alpha) * a_hat(t-1)``, ``max`` the largest of the last
H; ``current`` (CTS) uses each forward's own amax. The scale is ``max_val / a_hat / 2^margin``. Contract: the state
(history, scales, counters, what-if state) lives in buffers, so a checkpoint resumes exactly; nothing syncs with
the host; a NaN/inf amax never enters the history and a zero/NaN/inf a_hat never becomes a scale (the previous
one is kept); with no history yet, a delayed scaler uses current scaling.

See ``docs/glossary.md`` for the estimators and ``docs/diagnostics/saturation.md`` for the counters and headroom.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .estimators import AMAX_ALGOS, DELAYED_ALGOS, WHATIF_ALGOS, delayed_estimates
from .fake_quant import FakeQuantResult, compute_scale, fake_quantize, fake_quantize_current
from .formats import Float8Format, get_format, saturation_threshold
from .health import current_never_clips, measure_health, whatif_clipped, whatif_from_delayed
from .profiling import HEALTH, QUANTIZE, WHATIF, profiled
from .scaler_bank import ScalerBank, _data_parallel


class AmaxScaler(nn.Module):
    def __init__(
        self,
        algo: str = "max",
        history_len: int = 64,
        alpha: float = 0.1,
        max_val: float = 15.0,
        margin: float = 0.0,
        device: torch.device | str | None = None,
        power_2: bool = False,
        operand: str | None = None,
    ) -> None:
        super().__init__()
        if algo not in AMAX_ALGOS:
            raise ValueError(f"amax_algo: unknown algorithm {algo!r}; allowed: {', '.join(AMAX_ALGOS)}")
        self.algo = algo
        self.history_len = history_len
        self.alpha = alpha
        self.max_val = max_val
        self.margin = margin
        self.power_2 = power_2  # scales rounded down to a power of two (HiF8Recipe.power_2_scales)
        self.operand = operand  # the role of the tensor it scales (:class:`~.operand.Operand`'s value), if any
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("amax_history", torch.zeros(history_len, **f32))  # [0] = most recent step
        self.register_buffer("a_hat", torch.zeros((), **f32))
        self.register_buffer("scale", torch.ones((), **f32))
        self.register_buffer("steps_recorded", torch.zeros((), **i64))
        # this step's accumulators (max / sums over its micro-batches)
        self.register_buffer("step_amax", torch.zeros((), **f32))
        self.register_buffer("step_seen", torch.zeros((), **f32))
        self.register_buffer("step_clipped", torch.zeros((), **i64))
        self.register_buffer("step_numel", torch.zeros((), **i64))
        # the last completed step, for logging: true amax vs the a_hat it was quantized with
        self.register_buffer("last_amax", torch.zeros((), **f32))
        self.register_buffer("last_a_hat", torch.zeros((), **f32))
        self.register_buffer("last_clipped", torch.zeros((), **i64))
        self.register_buffer("last_numel", torch.zeros((), **i64))
        # run totals
        self.register_buffer("total_clipped", torch.zeros((), **i64))
        self.register_buffer("total_numel", torch.zeros((), **i64))
        self.register_buffer("saturation_events", torch.zeros((), **i64))  # steps with >= 1 clipped element
        self.register_buffer("quantized_steps", torch.zeros((), **i64))
        self.register_buffer("last_headroom", torch.full((), math.inf, **f32))  # a_hat / amax of the last step
        self.register_buffer("min_headroom", torch.full((), math.inf, **f32))
        # 1.0 when any data-parallel rank clipped this step (set by sync_step_amax; not checkpointed)
        self.register_buffer("step_clipped_anywhere", torch.zeros((), **f32), persistent=False)
        # what-if (qat_app.hif8.health): exp_smooth's estimate and the scale of every delayed estimator ...
        self.register_buffer("smoothed_a_hat", torch.zeros((), **f32))
        self.register_buffer("whatif_scale", torch.ones(len(DELAYED_ALGOS), **f32))
        # ... and, per estimator of WHATIF_ALGOS: this step's, the last step's and the run's clipped elements,
        # what-if saturation events, and (set by sync_step_amax) whether any rank's what-if clipped this step
        for name in ("step_whatif_clipped", "last_whatif_clipped", "total_whatif_clipped", "whatif_events"):
            self.register_buffer(name, torch.zeros(len(WHATIF_ALGOS), **i64))
        self.register_buffer("step_whatif_anywhere", torch.zeros(len(WHATIF_ALGOS), **f32), persistent=False)
        # Host-side mirrors of device state, so the hot path branches without a sync.
        self.has_history = False
        self.version = 0  # bumped whenever the scale may change (keys the weight cache)
        self.observed_this_step = False
        # this logging step's health vector (summed over its forwards) and the last completed step's; not buffers
        self.health_step: torch.Tensor | None = None
        self.health_last: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"algo={self.algo}, history_len={self.history_len}, max_val={self.max_val}, margin={self.margin}"
                + (", power_2" if self.power_2 else ""))

    def use_current_scaling(self) -> None:
        """From now on, current scaling (a fallback's remedy): its bank regroups at the next step boundary (banks
        are keyed by algorithm), and a weight cached with the delayed scale is stale."""
        self.algo = "current"
        self.version += 1

    @property
    def uses_current_scaling(self) -> bool:
        return self.algo == "current" or not self.has_history

    def quantize(self, x: torch.Tensor, fmt: str | Float8Format, *, want_codes: bool = False,
                 noise: torch.Tensor | None = None, fused: str = "off", grid: bool = False,
                 whatif: bool = False) -> tuple[FakeQuantResult, torch.Tensor]:
        """Fake-quantize ``x`` with this tensor's scale -> (result, the scale used).

        The one place that decides which scale: the delayed one (a snapshot: the buffer moves on at the
        step boundary), or the tensor's own (current scaling, and a delayed scaler before its first
        recorded step). ``grid``: the result holds the grid values instead of the dequantized tensor.
        ``whatif``: count the other estimators' clipping in the same pass where it can (a delayed scale and
        :func:`~qat_app.hif8.health.current_never_clips`; :meth:`measure` counts the rest with a pass of its own).
        """
        with profiled(QUANTIZE):
            if self.uses_current_scaling:
                return fake_quantize_current(x, self.scale, self.max_val, self.margin, fmt, want_codes=want_codes,
                                             power_2=self.power_2, noise=noise, fused=fused, grid=grid)
            # a fresh tensor: the compiled kernel must not see a buffer view (its offset: one more compilation)
            whatif_scales = self.whatif_scale.clone() if whatif and self._whatif_in_pass(fmt) else None
            result = fake_quantize(x, self.scale, self.max_val, fmt, want_codes=want_codes, noise=noise, fused=fused,
                                   grid=grid, whatif_scales=whatif_scales)
            return result, self.scale.clone()

    def _whatif_in_pass(self, fmt: str | Float8Format) -> bool:
        name = fmt if isinstance(fmt, str) else fmt.name
        return current_never_clips(self.max_val, self.margin, saturation_threshold(name, float(self.max_val)))

    @torch.no_grad()
    def measure(self, x: torch.Tensor, result: FakeQuantResult, scale: torch.Tensor, fmt: str | Float8Format, *,
                fused: str = "off", health: bool = False,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (what-if clipped counts, health vector) of one quantization of ``x`` (``quantize``'s ``result`` and
        ``scale``), for :meth:`observe`; device ops only.

        What-if: None before the first recorded step (no history to estimate from); from the quantize pass's
        counts when it made them (``quantize(..., whatif=True)``), else counted here. Its ``current`` entry
        uses the scale a CTS scaler with this history would fall back to (that of most_recent), as
        ``quantize`` does. Health (:func:`~qat_app.hif8.health.measure_health`): only when ``health``.
        """
        fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        whatif = None
        if self.has_history and result.whatif is not None:
            whatif = whatif_from_delayed(result.whatif, result.amax, self.max_val, self.margin)
        elif self.has_history:
            threshold = saturation_threshold(fmt.name, float(self.max_val))
            with profiled(WHATIF):
                whatif = whatif_clipped(x, self.whatif_scale, result.amax, self.max_val, self.margin, threshold,
                                        power_2=self.power_2, fused=fused)
        if not health:
            return whatif, None
        with profiled(HEALTH):
            return whatif, measure_health(x, scale, self.max_val, fmt, noise, fused=fused, grid=result.grid)

    @torch.no_grad()
    def observe(self, amax: torch.Tensor, clipped: torch.Tensor | None, numel: int,
                whatif: torch.Tensor | None = None, health: torch.Tensor | None = None) -> None:
        """Record one forward of the tensor (device ops only).

        ``clipped`` is None when the tensor was not quantized (warmup, switched off): its amax enters
        the history, its elements are not counted as quantized (nor what-if, nor health). ``whatif`` and
        ``health``: :meth:`measure`'s.
        """
        torch.maximum(self.step_amax, amax.float(), out=self.step_amax)
        self.step_seen.fill_(1.0)
        if clipped is not None:
            self.step_clipped.add_(clipped)
            self.step_numel.add_(numel)
            if whatif is not None:
                self.step_whatif_clipped.add_(whatif)
            if health is not None:
                self.health_step = health if self.health_step is None else self.health_step + health
        self.observed_this_step = True

    # The per-step update is the bank's batched code (:mod:`.scaler_bank`), run on a bank of one: a single
    # implementation, bit-identical whether a scaler is advanced alone or with every other scaler of the model.
    def bank(self) -> ScalerBank:
        """This scaler as a bank of one (its buffers become views into the bank's rows; reused while intact)."""
        bank = self.__dict__.get("_bank")
        return bank if bank is not None and bank.intact([self]) else ScalerBank([self])

    def advance(self) -> None:
        """Close one optimizer step: push its amax into the history and compute the next a_hat/scale."""
        self.bank().advance()

    def discard_step(self) -> None:
        """Forget this step's observations without touching the history (e.g. a skipped step)."""
        self.bank().discard()

    def seed_history(self) -> None:
        """Fill the window slots not yet recorded with the largest amax recorded so far.

        Called at the end of the BF16 warmup so the first quantized step already sees a full
        window even when the warmup was shorter than ``history_len``.
        """
        self.bank().seed_history()

    def _smoothed_before_whatif(self, saved: dict) -> torch.Tensor:
        """exp_smooth's estimate for a checkpoint that predates it: its own a_hat for an exp_smooth run, else
        the smoothing restarts at the most recent amax (the first-step rule)."""
        return saved["a_hat"].clone() if self.algo == "exp_smooth" else saved["amax_history"][0].clone()

    def _whatif_scale_before_whatif(self, saved: dict) -> torch.Tensor:
        """The delayed estimators' scales for a checkpoint that predates them: from its history, falling back
        to its scale where an estimate is not usable."""
        estimates = delayed_estimates(saved["amax_history"], saved["smoothed_a_hat"])
        return compute_scale(estimates, self.max_val, self.margin, saved["scale"].expand(len(DELAYED_ALGOS)),
                             self.power_2)

    # buffers added after checkpoints were first written: (name, value for a run that predates them, or the
    # method that derives it from the checkpoint's state; in this order, as a derivation may read an earlier one)
    LATER_BUFFERS = (("quantized_steps", 0), ("last_headroom", math.inf), ("min_headroom", math.inf),
                     ("step_whatif_clipped", 0), ("last_whatif_clipped", 0), ("total_whatif_clipped", 0),
                     ("whatif_events", 0), ("smoothed_a_hat", _smoothed_before_whatif),
                     ("whatif_scale", _whatif_scale_before_whatif))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, default in self.LATER_BUFFERS:  # older checkpoints keep loading
            if prefix + name in state_dict:
                continue
            if callable(default):
                saved = {n: state_dict[prefix + n] for n in ("a_hat", "scale", "amax_history", "smoothed_a_hat")
                         if prefix + n in state_dict}
                if {"a_hat", "scale", "amax_history"} <= saved.keys():  # else: a missing key, reported as such
                    state_dict[prefix + name] = default(self, saved)
            else:
                state_dict[prefix + name] = torch.full_like(getattr(self, name), default)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # one sync at load time (not per step) to restore the host-side mirror
        if self.steps_recorded.device.type != "meta":
            self.has_history = bool(self.steps_recorded.item() > 0)
        self.version += 1


def all_scalers(model: nn.Module) -> list[AmaxScaler]:
    return [m for m in model.modules() if isinstance(m, AmaxScaler)]


def keep_scalers_out_of_ddp_broadcast(module: nn.Module) -> None:
    """Tell ``DistributedDataParallel`` (call it before DDP wraps ``module``) not to broadcast the scalers' buffers.

    DDP copies rank 0's buffers to every rank before a forward (``broadcast_buffers``, on by default): that
    overwrites each rank's own counters (clipped, seen and what-if run totals), which are summed over the ranks
    when read, with rank 0's. The shared state (histories, a_hat, scales) needs no broadcast: ``sync_step_amax``
    keeps it equal on every rank.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = {f"{owner}.{name}" if owner else name for owner, m in module.named_modules()
             if isinstance(m, AmaxScaler) for name in m._buffers}
    names |= set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(names))


@torch.no_grad()
def sum_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (one SUM all-reduce; itself on one process).

    For the saturation counters (clipped, quantized elements), at logging time, never per forward.
    float64 so element counts stay exact far beyond 2^24.
    """
    if not _data_parallel(group):
        return values
    total = values.detach().double().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
