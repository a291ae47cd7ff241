"""KL divergence to the initial model on held-out text: the initial model's top-k cache and ``forget/kl``.

At the start of a fit the unquantized initial model keeps, on the first held-out blocks, its top-k next-token
log-probabilities plus one bucket for the rest of the vocabulary (``initial_topk.pt``). Every later validation
scores the same positions and logs the mean per-token KL(initial || now) with its 95 % interval and, with
``parts``, its drift and quantization parts. Contract: ``forget/kl`` is a lower bound of the full-vocabulary KL
(both sides coarse-grained onto the same partition) and exactly 0 for a model compared with itself; a missing,
damaged or foreign cache is named in one warning and the run goes on without ``forget/kl``. :func:`kl_between`
gives the same KL between the ``final_topk.pt`` files of two runs of one cache.

See ``docs/diagnostics/forgetting.md`` for the metrics, the files and their sizes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from qat_app.errors import ConfigError
from qat_app.eval.records import (FINAL_TOPK_FILE, FORGET_KL, FORGET_KL_DRIFT, FORGET_KL_QUANTIZATION,
                                  INITIAL_TOPK_FILE)
from qat_app.hif8.health import full_kl
from qat_app.hif8.patch import quantization_off, quantized_linears

log = logging.getLogger(__name__)

DEFAULT_TOPK = 32
DEFAULT_MAX_TOKENS = 262_144  # 256 sequences at seq 1024: 51.9 MB at k=32
INITIAL_FILE, FINAL_FILE = INITIAL_TOPK_FILE, FINAL_TOPK_FILE
FORMAT = 1
STORE_DTYPE = torch.float16
CHUNK_ELEMENTS = 1 << 25  # logits elements scored at a time (128 MiB in float32)
KL, DRIFT, QUANTIZATION = FORGET_KL, FORGET_KL_DRIFT, FORGET_KL_QUANTIZATION


class Interval(NamedTuple):
    """A mean and its 95 % interval (or, :func:`with_interval`, the names they are logged under)."""

    mean: Any
    low: Any
    high: Any


def with_interval(name: str) -> Interval:
    """A logged mean and its 95 % interval: ``name``, ``name_low``, ``name_high``."""
    return Interval(name, f"{name}_low", f"{name}_high")


METRICS = with_interval(KL)


class TopKCacheError(ValueError):
    """A top-k file that cannot be used: missing, damaged, or of another model / data / partition."""


def check_settings(topk: Any, max_tokens: Any, section: str = "initial_eval") -> None:
    """``initial_eval.topk`` and ``initial_eval.max_kl_tokens``: integers >= 1 (a :class:`ConfigError` naming it)."""
    for name, value in (("topk", topk), ("max_kl_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{section}.{name}: must be an integer >= 1, got {value!r}")
        if value < 1:
            raise ConfigError(f"{section}.{name}: must be >= 1, got {value}")


# ------------------------------------------------------------------------------------------ the numbers
def _rows(logits: torch.Tensor, *others: torch.Tensor):
    """``logits [..., V]`` (and tensors of the same leading shape) in row chunks of at most CHUNK_ELEMENTS."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    rest = [o.reshape(flat.shape[0], *o.shape[logits.dim() - 1:]) for o in others]
    step = max(1, CHUNK_ELEMENTS // V)
    for i in range(0, flat.shape[0], step):
        yield (flat[i:i + step], *[o[i:i + step] for o in rest])


def logprobs_at(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., k+1]``: log-softmax of ``logits [..., V]`` at ``indices [..., k]``, then the log of the
    remaining mass (the log-sum-exp of every other logit: stable where the top-k hold nearly everything)."""
    out = []
    for x, idx in _rows(logits, indices):
        x = x.float()
        idx = idx.long()
        lse = x.logsumexp(-1, keepdim=True)
        rest = x.scatter(-1, idx, float("-inf")).logsumexp(-1, keepdim=True)
        out.append(torch.cat([x.gather(-1, idx), rest], -1) - lse)
    return torch.cat(out).view(*logits.shape[:-1], indices.shape[-1] + 1)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (int32 indices ``[..., k']``, float32 log-probs ``[..., k'+1]``) of the ``k' = min(k, V)`` most likely
    tokens, the last entry the rest bucket (-inf when ``k >= V``)."""
    k = min(k, logits.shape[-1])
    indices = torch.cat([x.topk(k, dim=-1).indices for (x,) in _rows(logits)]).view(*logits.shape[:-1], k)
    return indices.to(torch.int32), logprobs_at(logits, indices)


def coarse_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) of two distributions over the same ``k+1`` buckets (log-probs, any float dtype),
    in float32. Each side is renormalised first (float16 storage leaves them off 1 by ~1e-3), so the result
    is >= 0 and exactly 0 for equal inputs; a bucket with p = 0 contributes 0."""
    a, b = (x - x.logsumexp(-1, keepdim=True) for x in (logp.float(), logq.float()))
    terms = torch.where(torch.isneginf(a), torch.zeros_like(a), a.exp() * (a - b))
    return terms.sum(-1).clamp_min(0.0)


def interval(sequence_means: torch.Tensor) -> Interval:
    """(mean, mean - 1.96 SE, mean + 1.96 SE) of per-sequence means (SE with n-1; NaN bounds for n < 2)."""
    x = sequence_means.double().flatten()
    mean = float(x.mean()) if x.numel() else math.nan
    if x.numel() < 2:
        return Interval(mean, math.nan, math.nan)
    half = 1.96 * float(x.std(unbiased=True)) / math.sqrt(x.numel())
    return Interval(mean, mean - half, mean + half)


def kept_positions(seq_len: int, available: int, max_tokens: int, world_size: int = 1) -> tuple[int, int]:
    """-> (sequences per rank, positions per sequence) the cache keeps of ``available`` blocks per rank."""
    positions = min(seq_len, max_tokens)
    per_rank = max(1, (max_tokens // positions) // max(1, world_size))
    return min(per_rank, available), positions


# ------------------------------------------------------------------------------------------ the files
def tensor_sha256(tensors, names=None) -> str:
    """SHA-256 of the tensors' bytes in order, each after its name where ``names`` are given (the same weights give
    the same digest whatever object holds them): the cache's payload check and the distillation teacher's."""
    h = hashlib.sha256()
    for i, t in enumerate(tensors):
        if names is not None:
            h.update(names[i].encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class TopKFile:
    """A top-k file as read back: ``header`` and its tensors (``tokens`` / ``indices`` only in the initial one)."""

    header: dict
    logprobs: torch.Tensor
    tokens: torch.Tensor | None = None
    indices: torch.Tensor | None = None


def save_topk(path: str, header: dict, logprobs: torch.Tensor, tokens=None, indices=None) -> dict:
    """Write a top-k file atomically (a temporary file renamed over ``path``); -> the header written."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in
               (("logprobs", logprobs), ("tokens", tokens), ("indices", indices)) if v is not None}
    header = {**header, "format": FORMAT, "payload_sha256": tensor_sha256(tensors.values())}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"header": header, **tensors}, tmp)
    os.replace(tmp, path)
    return header


def load_topk(path: str) -> TopKFile:
    """Read a top-k file; :class:`TopKCacheError` names a missing, unreadable or damaged one."""
    if not os.path.isfile(path):
        raise TopKCacheError(f"{path}: no such file")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        header = dict(raw["header"])
        tensors = [raw[k] for k in ("logprobs", "tokens", "indices") if k in raw]
        ok = header.get("format") == FORMAT and header.get("payload_sha256") == tensor_sha256(tensors)
    except Exception as err:  # truncated, not a torch file, not ours
        raise TopKCacheError(f"{path}: damaged ({type(err).__name__}: {err})") from None
    if not ok:
        raise TopKCacheError(f"{path}: damaged (format or checksum of its tensors does not match its header)")
    return TopKFile(header, raw["logprobs"], raw.get("tokens"), raw.get("indices"))


def foreign_to_run(header: dict, kind: str, complete: bool, model_name: str, world: int,
                   expected_sha256: str | None) -> list[str]:
    """Why a file read back on resume is not this run's (its payload, kind, model or world size), or []."""
    foreign = []
    if expected_sha256 and header.get("payload_sha256") != expected_sha256:
        foreign.append(f"payload {str(header.get('payload_sha256'))[:12]}, this run's checkpoint names "
                       f"{expected_sha256[:12]}")
    if header.get("kind") != kind or not complete:
        foreign.append(f"kind {header.get('kind')!r}, not {kind!r}")
    if header.get("model") != model_name:
        foreign.append(f"model {header.get('model')!r}, this run {model_name!r}")
    if header.get("world_size") != world:
        foreign.append(f"world size {header.get('world_size')}, this run {world}")
    return foreign


class KLBetween(NamedTuple):
    """KL(a || b) per token between two top-k files: the mean, its 95 % interval over sequences, the tokens."""

    mean: float
    low: float
    high: float
    tokens: int


def kl_between(file_a: str, file_b: str) -> KLBetween:
    """KL(a || b) per token between two top-k files of the same initial cache (``initial_topk.pt`` or
    ``final_topk.pt`` of runs that share it: same model, data and top-k partition), e.g. KL(baseline || QAT)
    of two runs' ``final_topk.pt``. -> (mean, low, high, n_tokens), the interval over sequences as ``forget/kl``.
    A lower bound of the full-vocabulary KL (see the module doc). Raises :class:`TopKCacheError`."""
    a, b = load_topk(file_a), load_topk(file_b)
    if a.header.get("partition") != b.header.get("partition") or a.logprobs.shape != b.logprobs.shape:
        raise TopKCacheError(
            f"{file_a} and {file_b} are not of the same initial top-k cache (partition "
            f"{str(a.header.get('partition'))[:12]} vs {str(b.header.get('partition'))[:12]}, shapes "
            f"{tuple(a.logprobs.shape)} vs {tuple(b.logprobs.shape)}): same model and data needed")
    kl = coarse_kl(a.logprobs, b.logprobs)  # [N, L]
    return KLBetween(*interval(kl.double().mean(-1)), kl.numel())


# ------------------------------------------------------------------------------------------ in a fit
@dataclass
class KLResult:
    """One validation's KL(initial || now): the mean per token, its 95 % interval over sequences; with the parts,
    ``drift`` = KL(initial || now with quantization off) and ``quantization`` = KL(now off || now on), each
    (mean, low, high)."""

    step: int
    mean: float
    low: float
    high: float
    tokens: int
    sequences: int
    drift: tuple[float, float, float] | None = None
    quantization: tuple[float, float, float] | None = None

    def metrics(self) -> dict[str, float]:
        out = dict(zip(METRICS, (self.mean, self.low, self.high)))
        for name, part in ((DRIFT, self.drift), (QUANTIZATION, self.quantization)):
            if part is not None:
                out.update(zip(with_interval(name), part))
        return out


def _gather(pl_module, t: torch.Tensor) -> torch.Tensor:
    """All ranks' ``t`` stacked ``[world, ...]`` (Lightning drops the world dimension on one process)."""
    world = pl_module.trainer.world_size if pl_module._trainer is not None else 1
    out = pl_module.all_gather(t) if world > 1 else t.unsqueeze(0)
    return out.reshape(world, *t.shape)


@contextmanager
def evaluating(pl_module):
    """``pl_module`` in eval mode under the run's validation precision; its mode restored after."""
    was_training = pl_module.training
    pl_module.eval()
    try:
        with pl_module.trainer.precision_plugin.val_step_context():
            yield
    finally:
        pl_module.train(was_training)


def held_out_blocks(trainer) -> tuple[torch.Tensor, int, int] | None:
    """-> (this rank's held-out LM blocks ``[n, seq_len]``, the validation batch size, how many of them a
    validation scores), or None when the data has no LM validation. The data's ``limit_val_batches`` (where
    ``main.py`` puts ``trainer.limit_val_batches``: the LM validation's alone) is applied by ``val_blocks``; a
    trainer's own limit, by Lightning's rule, on top."""
    from qat_app.data.pretrain import limited_items

    datamodule = trainer.datamodule
    if not callable(getattr(datamodule, "val_blocks", None)) or not getattr(datamodule, "val_documents", 0):
        return None
    if getattr(datamodule, "limit_val_batches", None) == 0:
        return None
    blocks = datamodule.val_blocks(trainer.global_rank, trainer.world_size)
    batch_size = int(getattr(datamodule, "val_batch_size", None) or 1)
    n = limited_items(blocks.shape[0], batch_size, trainer.limit_val_batches)
    return (blocks, batch_size, n) if n > 0 else None


class InitialKL:
    """The fit's top-k cache of the initial model and the ``forget/kl`` computation.

    Lifecycle (driven by :class:`callbacks.initial_eval.InitialEvaluationCallback`; the module only calls
    :meth:`update` in its LM ``validation_step``): :meth:`record` at the start of a new fit, or :meth:`resume`
    on a resumed one; :meth:`begin` / :meth:`update` / :meth:`finish` around every validation, ``finish``
    returning a :class:`KLResult` (None when nothing was measured). ``last`` holds the latest result.

    Args:
        topk: tokens kept per position (k, >= 1).
        max_tokens: positions kept at most (>= 1), see the module doc.
        model_name: the model's name, stored in the header (a cache of another model is refused).
        path: the initial cache file (the fit's: :meth:`callbacks.initial_eval.InitialEvaluationCallback.cache_path`).
    """

    def __init__(self, topk: int = DEFAULT_TOPK, max_tokens: int = DEFAULT_MAX_TOKENS, model_name: str = "",
                 path: str = INITIAL_FILE, parts: bool = True) -> None:
        check_settings(topk, max_tokens)
        self.topk, self.max_tokens, self.model_name, self.path = topk, max_tokens, str(model_name), path
        self.parts = parts
        self._drift: list[torch.Tensor] = []
        self._quantization: list[torch.Tensor] = []
        self.header: dict | None = None  # of the cache in use; None: forget/kl is off
        self.tokens = self.indices = self.logprobs = None  # this rank's slice, on the module's device
        self.last: KLResult | None = None
        self.active = False
        self._seen = 0
        self._sums: list[torch.Tensor] = []
        self._logq: list[torch.Tensor] = []
        self._mismatch: torch.Tensor | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.header is not None

    def _off(self, why: str) -> None:
        self.header = self.tokens = self.indices = self.logprobs = None
        if not self._warned:
            self._warned = True
            log.warning("forget/kl off for this run: %s", why)

    # --- the initial model
    @torch.no_grad()
    def record(self, pl_module, blocks: torch.Tensor, batch_size: int, limit: int | None = None) -> None:
        """Score this rank's held-out ``blocks [n, seq_len]`` with the model as it is (the caller switches
        quantization off); rank 0 writes the cache. Every rank calls it (collective)."""
        trainer = pl_module.trainer
        n, positions = kept_positions(blocks.shape[1], blocks.shape[0] if limit is None else min(limit, blocks.shape[0]),
                                      self.max_tokens, trainer.world_size)
        n = int(_gather(pl_module, torch.tensor(n, device=pl_module.device)).min())  # equal on every rank
        if n == 0:
            return self._off("no held-out validation blocks to take the initial cache on")
        tokens = blocks[:n, :positions].to(pl_module.device)
        indices, logprobs = [], []
        with evaluating(pl_module):
            for i in range(0, n, batch_size):  # the validation's own batches (same shapes, same numerics)
                logits = pl_module.model(input_ids=blocks[i:i + batch_size].to(pl_module.device)).logits
                idx, lp = topk_logprobs(logits[:n - i, :positions], self.topk)
                indices.append(idx)
                logprobs.append(lp.to(STORE_DTYPE))
        self.tokens, self.indices = tokens.to(torch.int32), torch.cat(indices)
        self.logprobs = torch.cat(logprobs)
        world = trainer.world_size
        every = [_gather(pl_module, t).flatten(0, 1) for t in (self.tokens, self.indices, self.logprobs)]
        header = self._header(every[0], every[1], n, positions, world, "initial", step=0)
        if trainer.is_global_zero:
            header = save_topk(self.path, header, every[2], tokens=every[0], indices=every[1])
        self.header = header
        log.info("initial top-%d cache: %d sequences x %d positions (%d tokens) in %s", self.indices.shape[-1],
                 n * world, positions, n * world * positions, self.path)

    def _header(self, tokens, indices, n, positions, world, kind, step) -> dict:
        data = tensor_sha256([tokens])
        return {"kind": kind, "k": int(indices.shape[-1]), "sequences": int(n * world), "positions": int(positions),
                "tokens": int(n * world * positions), "world_size": int(world), "model": self.model_name,
                "data_fingerprint": data, "partition": tensor_sha256([indices]) + data, "global_step": int(step),
                "dtype": str(STORE_DTYPE).replace("torch.", "")}

    def resume(self, pl_module, blocks: torch.Tensor, expected_sha256: str | None = None) -> None:
        """A resumed fit: read the cache back and check it is of this model, data and world size (and, when
        the checkpoint recorded it, the very payload this run took); else one warning and ``forget/kl`` stays off."""
        trainer = pl_module.trainer
        try:
            cache = load_topk(self.path)
        except TopKCacheError as err:
            return self._off(f"the initial top-k cache cannot be used: {err}")
        h = cache.header
        world, rank = trainer.world_size, trainer.global_rank
        foreign = foreign_to_run(h, "initial", cache.tokens is not None and cache.indices is not None,
                                 self.model_name, world, expected_sha256)
        if not foreign:
            n = h["sequences"] // world
            mine = slice(rank * n, (rank + 1) * n)
            here = blocks[:n, :h["positions"]].to(torch.int32)
            if here.shape != cache.tokens[mine].shape or not torch.equal(here, cache.tokens[mine]):
                foreign.append(f"other validation data (fingerprint {h.get('data_fingerprint', '')[:12]})")
        if foreign:
            return self._off(f"{self.path} is of another run: {'; '.join(foreign)}")
        device = pl_module.device
        self.tokens, self.indices, self.logprobs = (t[mine].to(device) for t in (cache.tokens, cache.indices,
                                                                                cache.logprobs))
        self.header = h
        if h["k"] != self.topk or h["tokens"] > self.max_tokens:
            log.info("forget/kl: the cache's k=%d, %d tokens are used (settings: topk=%d, max_kl_tokens=%d)",
                     h["k"], h["tokens"], self.topk, self.max_tokens)

    # --- every validation
    def begin(self, trainer) -> None:
        """A validation starts: measure in it when the cache is in use and this is a fit's validation after step 0."""
        self.active = (self.enabled and trainer.state.fn == "fit" and not trainer.sanity_checking
                       and trainer.global_step > 0)
        self._seen, self._sums, self._logq, self._mismatch = 0, [], [], None
        self._drift, self._quantization = [], []

    def update(self, input_ids: torch.Tensor, logits: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        """One LM validation batch (in loader order): device operations only, no host sync. With ``model`` (the
        one that gave ``logits``) and ``parts``, the batch is scored again with quantization off for the parts."""
        if not self.active:
            return
        start, n = self._seen, input_ids.shape[0]
        self._seen += n
        take = min(n, self.tokens.shape[0] - start)
        if take <= 0:
            return
        L = self.tokens.shape[1]
        rows = slice(start, start + take)
        bad = (input_ids[:take, :L] != self.tokens[rows]).any()
        self._mismatch = bad if self._mismatch is None else self._mismatch | bad
        logq = logprobs_at(logits[:take, :L], self.indices[rows]).to(STORE_DTYPE)
        self._sums.append(coarse_kl(self.logprobs[rows], logq).sum(-1))
        self._logq.append(logq)
        if self.parts and model is not None:
            self._score_parts(input_ids, logits, model, rows, take, L)

    def _score_parts(self, input_ids, logits, model, rows, take: int, L: int) -> None:
        """Drift on the cache's partition (a lower bound, like ``forget/kl``); quantization over the full vocabulary
        (exact: both logits are at hand). The whole batch is scored again, as the initial model was, so a model
        that did not change gives the initial log-probs bit for bit (drift exactly 0)."""
        if quantized_linears(model):
            with quantization_off(model):
                off = model(input_ids=input_ids).logits[:take, :L]
        else:  # nothing to switch off: the same forward
            off = logits[:take, :L]
        drift_logq = logprobs_at(off, self.indices[rows]).to(STORE_DTYPE)
        self._drift.append(coarse_kl(self.logprobs[rows], drift_logq).sum(-1))
        self._quantization.append(full_kl(off, logits[:take, :L]).sum(-1).float())

    def finish(self, pl_module, log_dir: str | None) -> KLResult | None:
        """A validation ends: reduce over the ranks, write ``<log_dir>/final_topk.pt`` (rank 0), -> the result."""
        if not self.active:
            return None
        self.active = False
        n, L = self.tokens.shape[:2]
        seen = min(self._seen, n)
        mismatch = bool(self._mismatch) if self._mismatch is not None else False
        flags = _gather(pl_module, torch.tensor([seen, int(mismatch)], device=pl_module.device))
        if bool(flags[:, 1].any()):
            self._off("the validation blocks differ from the ones the initial cache was taken on")
            return None
        if int(flags[:, 0].min()) < n:
            self._off(f"the validation scored {int(flags[:, 0].min())} of the cache's {n} sequences per rank "
                      "(limit_val_batches changed?)")
            return None
        sums = _gather(pl_module, torch.cat(self._sums)).flatten()
        mean, low, high = interval(sums.double() / L)
        drift, quantization = (interval(_gather(pl_module, torch.cat(part)).flatten().double() / L) if part else None
                               for part in (self._drift, self._quantization))
        step = pl_module.trainer.global_step
        self.last = KLResult(step, mean, low, high, int(sums.numel() * L), int(sums.numel()), drift, quantization)
        logq = _gather(pl_module, torch.cat(self._logq)).flatten(0, 1)
        self._sums, self._logq, self._drift, self._quantization = [], [], [], []
        if log_dir is not None and pl_module.trainer.is_global_zero:
            header = {**self.header, "kind": "final", "global_step": int(step)}
            header.pop("payload_sha256", None)
            save_topk(os.path.join(log_dir, FINAL_FILE), header, logq)
        return self.last
