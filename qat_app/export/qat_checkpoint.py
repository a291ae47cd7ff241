"""The source of the command-line export: a ``QATModule`` restored from a Lightning checkpoint."""

from __future__ import annotations

import inspect
import logging
import os

from ..config import QuantConfig
from ..errors import CheckpointError
from ..precision import COMPUTE_DTYPES, PRECISION_DTYPES

log = logging.getLogger(__name__)


def load_qat_checkpoint(path: str | os.PathLike, weights_only: bool = True, trust_remote_code: bool = False):
    """A ``QATModule`` restored from a Lightning checkpoint (hyper-parameters + state dict), in eval mode: a file,
    or a sharded (FSDP2) checkpoint directory read whole on this process (:func:`qat_app.checkpoint.read_checkpoint`).

    The file is read as data (``weights_only``; the classes earlier versions pickled are allowlisted in
    :mod:`qat_app.checkpoint`); ``trust_remote_code`` is the caller's, whatever the checkpoint's hyper-parameters
    say. Raises :class:`qat_app.errors.CheckpointError` naming the file when it is unreadable or truncated, not a
    QATModule checkpoint, or (:class:`qat_app.errors.UnsafeFileError`) holds pickled code.
    """
    from ..checkpoint import read_checkpoint
    from ..module import CHECKPOINT_KEY, QATModule

    path = str(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist (--ckpt_path)")
    ckpt = read_checkpoint(path, weights_only=weights_only)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    hparams = ckpt.get("hyper_parameters") or {}
    state = ckpt["state_dict"]
    if "model_name" not in hparams or not any(k.startswith("model.") for k in state):
        marker = " (it has no qat_app entry either)" if CHECKPOINT_KEY not in ckpt else ""
        raise CheckpointError(
            f"{path} is not a QATModule checkpoint: it needs hyper-parameters with 'model_name' and a state dict "
            f"under 'model.' (found hyper-parameters {sorted(hparams)[:8]}){marker}"
        )
    accepted = set(inspect.signature(QATModule.__init__).parameters) - {"self"}
    kwargs = {k: v for k, v in dict(hparams).items() if k in accepted}
    if kwargs.get("trust_remote_code") and not trust_remote_code:
        log.info("%s: its hyper-parameters ask for trust_remote_code; not taken from a file (--trust_remote_code)", path)
    kwargs["trust_remote_code"] = bool(trust_remote_code)
    kwargs.pop("distill", None)  # reading a run needs no teacher
    if kwargs.get("quant") is not None:  # a plain dict (today), or an earlier version's pickled QuantConfig
        kwargs["quant"] = QuantConfig.coerce(kwargs["quant"])
    module = QATModule(**kwargs)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path}: the state dict does not fit the QATModule its hyper-parameters describe: {err}") from None
    module.restore_run((ckpt.get(CHECKPOINT_KEY) or {}).get("precision"))
    return module


FALLBACK_DTYPE = "bfloat16"  # an export's storage dtype for a checkpoint that does not record its precision


def run_compute_dtype(module) -> tuple[str | None, str]:
    """(the dtype ``module``'s run computed its quantized linears in, why), read from the checkpoint's precision;
    None (each layer's weight dtype) for a checkpoint that does not record it."""
    precision = getattr(module, "run_precision", None)
    if precision in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[precision], f"the run's precision {precision}"
    return None, "the checkpoint does not record the run's precision (written by an earlier version): the weights' dtype"


def run_dtype(module) -> tuple[str, str]:
    """(the default storage dtype of an export of ``module``, why): the dtype its run computed the unquantized
    tensors in, read from the checkpoint's precision; bfloat16 for a checkpoint that does not record it."""
    precision = getattr(module, "run_precision", None)
    if precision in PRECISION_DTYPES:
        return PRECISION_DTYPES[precision], f"the run's precision {precision}"
    return FALLBACK_DTYPE, "the checkpoint does not record the run's precision (written by an earlier version)"
