"""The readable definition of one scaler's per-step update, one tensor at a time (the paper's equations):
the independent reference that the batched code (``qat_app.hif8.scaler_bank.ScalerBank``) and
``AmaxScaler`` (which runs that code as a bank of one) are tested against, bit for bit.

Plain 0-d float32 / int64 tensors with Python control flow, no stacking, no masks; the attribute names are
``AmaxScaler``'s buffer names, so :meth:`ReferenceScaler.state` compares with its ``state_dict``.
"""

from __future__ import annotations

import math

import torch

F32_STATE = ("a_hat", "scale", "step_amax", "step_seen", "last_amax", "last_a_hat", "last_headroom",
             "min_headroom", "step_clipped_anywhere")
I64_STATE = ("steps_recorded", "step_clipped", "step_numel", "last_clipped", "last_numel", "total_clipped",
             "total_numel", "saturation_events", "quantized_steps")


class ReferenceScaler:
    def __init__(self, algo: str, history_len: int = 64, alpha: float = 0.1, max_val: float = 15.0,
                 margin: float = 0.0) -> None:
        self.algo, self.history_len, self.alpha, self.max_val, self.margin = algo, history_len, alpha, max_val, margin
        self.amax_history = torch.zeros(history_len)  # [0] = most recent recorded step
        for name in F32_STATE:
            setattr(self, name, torch.tensor(1.0 if name == "scale" else 0.0))
        for name in I64_STATE:
            setattr(self, name, torch.tensor(0))
        self.last_headroom = self.min_headroom = torch.tensor(math.inf)

    @property
    def uses_current_scaling(self) -> bool:  # current scaling, or a delayed scaler before its first recorded step
        return self.algo == "current" or self.steps_recorded == 0

    def observe(self, amax: torch.Tensor, clipped: torch.Tensor | None, numel: int) -> None:
        self.step_amax = torch.maximum(self.step_amax, amax.float())
        self.step_seen = torch.tensor(1.0)
        if clipped is not None:
            self.step_clipped, self.step_numel = self.step_clipped + clipped, self.step_numel + numel

    def _scale_of(self, a_hat: torch.Tensor) -> torch.Tensor:
        """s = max_val / a_hat / 2^margin; a zero, NaN or inf a_hat keeps the previous scale."""
        scale = self.max_val / a_hat / (2.0**self.margin)
        ok = a_hat > 0 and math.isfinite(a_hat) and math.isfinite(scale)
        return scale if ok else self.scale

    def advance(self) -> None:
        amax = self.step_amax
        valid = bool(torch.isfinite(amax)) and self.step_seen > 0  # NaN/inf or an unseen step: not recorded
        quantized = self.step_numel > 0
        self.last_amax, self.last_a_hat = amax, amax if self.uses_current_scaling else self.a_hat
        self.last_clipped, self.last_numel = self.step_clipped, self.step_numel
        self.total_clipped, self.total_numel = self.total_clipped + self.step_clipped, self.total_numel + self.step_numel
        self.saturation_events = self.saturation_events + int(self.step_clipped > 0 or self.step_clipped_anywhere > 0)
        self.quantized_steps = self.quantized_steps + int(quantized)
        self.last_headroom = self.last_a_hat / amax if quantized and valid and amax > 0 else torch.tensor(math.inf)
        self.min_headroom = torch.minimum(self.min_headroom, self.last_headroom)
        if valid:
            first = self.steps_recorded == 0
            self.amax_history = torch.cat([amax.view(1), self.amax_history[:-1]])
            if self.algo == "max":  # max(amax(t-1), ..., amax(t-H))
                self.a_hat = self.amax_history.max()
            elif self.algo == "exp_smooth":  # alpha amax(t-1) + (1 - alpha) a_hat(t-1); a_hat(1) = amax(0)
                self.a_hat = amax if first else self.alpha * amax + (1.0 - self.alpha) * self.a_hat
            else:  # most_recent: amax(t-1); current: the same, for logging and fallback
                self.a_hat = self.amax_history[0]
            self.steps_recorded = self.steps_recorded + 1
        self.scale = self._scale_of(self.a_hat)
        self.discard_step()

    def discard_step(self) -> None:
        self.step_amax, self.step_seen, self.step_clipped_anywhere = torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.0)
        self.step_clipped, self.step_numel = torch.tensor(0), torch.tensor(0)

    def seed_history(self) -> None:
        """The slots not yet recorded take the largest amax recorded so far; a_hat and the scale follow."""
        n = int(self.steps_recorded)
        if n < self.history_len:
            fill = self.amax_history[:n].max() if n else torch.tensor(0.0)
            self.amax_history = torch.cat([self.amax_history[:n], fill.expand(self.history_len - n)])
        if self.algo == "max":
            self.a_hat = self.amax_history.max()
        elif self.algo in ("most_recent", "current"):
            self.a_hat = self.amax_history[0]
        self.scale = self._scale_of(self.a_hat)

    def state(self) -> dict[str, torch.Tensor]:
        """Every quantity, under ``AmaxScaler``'s buffer names (``step_clipped_anywhere`` included)."""
        return {"amax_history": self.amax_history, **{n: getattr(self, n) for n in F32_STATE + I64_STATE}}
