"""Pre-flight checks: settings a run cannot work with, refused before anything is built or written.

Each check raises :class:`qat_app.errors.ConfigError` (or the data's / the model source's own error) with one
line naming the setting; :class:`qat_app.cli.QATCLI` calls them in this order:

* before any command (:func:`qat_app.cli.main`): :func:`check_torch` (torch inside :data:`TORCH_RANGE`);
* on the parsed config, before the model is loaded: :func:`relocate_run` (``--run_dir``),
  :func:`check_accelerator`, :func:`check_model_settings`, :func:`derive_gradient_accumulation` (which also
  checks the batch arithmetic), :func:`derive_validation_interval`, :func:`route_limit_val_batches`
  and, for ``fit``, :func:`check_fit_settings`;
* on the built objects, before the trainer writes anything: :func:`check_data`, and for ``validate`` /
  ``test`` without a checkpoint :func:`refuse_quantized_model_without_history`.

The checkpoint given with ``--ckpt_path`` is checked by :mod:`qat_app.checkpoint` (the resume policy).
"""

from __future__ import annotations

import logging
import os
import re

from qat_app.errors import ConfigError, did_you_mean, settings_of

log = logging.getLogger(__name__)

# The torch versions this project supports (oldest and newest major.minor, both ends tested: the GPU image's 2.11 by
# `make gpu-rehearsal`, requirements.txt's 2.13 by the suite). pyproject.toml's torch requirement says the same.
TORCH_RANGE = ((2, 11), (2, 13))


def torch_outside_range(version: str) -> str | None:
    """One line on torch ``version`` (``torch.__version__``) outside :data:`TORCH_RANGE`; None inside it (local and
    pre-release tags count as their major.minor: ``2.11.0+cu130``, ``2.12.0a0+git``)."""
    low, high = TORCH_RANGE
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found and low <= (int(found[1]), int(found[2])) <= high:
        return None
    return (f"torch {version} is outside the supported range {low[0]}.{low[1]}-{high[0]}.{high[1]} (install one: "
            f"pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'; QAT_APP_ANY_TORCH=1 runs anyway, "
            "untested)")


def check_torch() -> None:
    """The installed torch inside :data:`TORCH_RANGE`, else a :class:`ConfigError` (a warning with
    QAT_APP_ANY_TORCH=1), before anything else runs."""
    import torch

    problem = torch_outside_range(torch.__version__)
    if problem and os.environ.get("QAT_APP_ANY_TORCH") == "1":
        log.warning("%s: going on (QAT_APP_ANY_TORCH=1)", problem.split(" (")[0])
    elif problem:
        raise ConfigError(problem)


def world_size(trainer_cfg) -> int:
    """Devices x nodes that ``trainer.devices`` / ``num_nodes`` ask for (``auto``: every visible GPU, else 1)."""
    import torch

    devices = trainer_cfg.get("devices", "auto")
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, str) and devices not in ("auto", "-1"):
        count = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    else:  # auto / -1: every visible accelerator
        accelerator = trainer_cfg.get("accelerator", "auto")
        count = torch.cuda.device_count() if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else 1
    return max(1, count) * max(1, int(trainer_cfg.get("num_nodes", 1) or 1))


def _relocated(path, old_root: str, new_root: str, field: str) -> str:
    path, old = os.path.normpath(str(path)), os.path.normpath(old_root)
    if path == old:
        return new_root
    if old == "." and not os.path.isabs(path):
        return os.path.join(new_root, path)
    if path.startswith(old.rstrip(os.sep) + os.sep):
        return os.path.join(new_root, os.path.relpath(path, old))
    raise ConfigError(f"--run_dir {new_root}: {field}={path} is not under trainer.default_root_dir={old_root}, "
                      "so it cannot be moved with the run; put it under default_root_dir or set it explicitly")


def relocate_run(trainer_cfg, run_dir: str) -> None:
    """``--run_dir DIR``: every path of the run under ``trainer.default_root_dir`` (the loggers' ``save_dir``,
    the callbacks' ``dirpath``) moves to the same place under DIR, and DIR becomes the default_root_dir."""
    old_root = trainer_cfg.get("default_root_dir") or "."
    for section, key in (("logger", "save_dir"), ("callbacks", "dirpath")):
        entries = trainer_cfg.get(section)
        if entries is None or isinstance(entries, bool):
            continue
        for i, entry in enumerate(entries if isinstance(entries, list) else [entries]):
            init_args = entry.get("init_args") if hasattr(entry, "get") else None
            if init_args is not None and init_args.get(key):
                init_args[key] = _relocated(init_args[key], old_root, run_dir,
                                            f"trainer.{section}[{i}].init_args.{key}")
    trainer_cfg.default_root_dir = run_dir


def check_accelerator(trainer_cfg) -> None:
    """``trainer.accelerator`` / ``devices`` / ``strategy`` that this machine cannot run, refused before the
    batch arithmetic (which would otherwise report the wrong cause) and before Lightning's own traceback."""
    import torch
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    accelerator, devices = trainer_cfg.get("accelerator", "auto"), trainer_cfg.get("devices", "auto")
    strategy = trainer_cfg.get("strategy", "auto")
    if isinstance(accelerator, str):
        known = ["auto", "gpu", *AcceleratorRegistry.available_accelerators()]
        if accelerator not in known:
            raise ConfigError(f"trainer.accelerator={accelerator}: unknown; expected one of {', '.join(known)}"
                              + did_you_mean(accelerator, known))
        if accelerator in ("gpu", "cuda"):
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if visible == 0:
                raise ConfigError(f"trainer.accelerator={accelerator}, but torch sees no CUDA GPU on this machine "
                                  "(torch.cuda.is_available() is False); use --trainer.accelerator cpu")
            wanted = world_size({"devices": devices, "accelerator": accelerator})
            if wanted > visible:
                raise ConfigError(f"trainer.devices={devices}: this machine has {visible} visible GPU(s)")
    if str(getattr(strategy, "class_path", strategy)).rsplit(".", 1)[-1] in ("ModelParallelStrategy", "model_parallel"):
        init = (strategy.get("init_args") if hasattr(strategy, "get") else None) or {}
        world = world_size(trainer_cfg)
        tp, dp = init.get("tensor_parallel_size", "auto"), init.get("data_parallel_size", "auto")
        if world > 1 and (tp != 1 or dp != world):
            raise ConfigError(
                f"trainer.strategy: ModelParallelStrategy needs init_args {{data_parallel_size: {world}, "
                f"tensor_parallel_size: 1}} here (FSDP2 over all {world} devices; HiF8 QAT does no tensor "
                f"parallelism), got data_parallel_size={dp}, tensor_parallel_size={tp}")
    if isinstance(strategy, str) and strategy != "auto":
        known = StrategyRegistry.available_strategies()
        if strategy not in known:
            raise ConfigError(f"trainer.strategy={strategy}: unknown; e.g. ddp, fsdp, model_parallel, auto"
                              + did_you_mean(strategy, known))


def check_model_settings(model_cfg) -> None:
    """The model source (hub id, local directory, GGUF file) and ``dtype``, before anything is downloaded or loaded."""
    model_cfg = model_cfg or {}
    if model_cfg.get("model_name") is None:
        return
    from qat_app.models import check_model_source, resolve_dtype

    check_model_source(model_cfg.get("model_name"), model_cfg.get("gguf_file"))
    resolve_dtype(model_cfg.get("dtype", "float32"))


def check_gemm(cfg) -> None:
    """``model.quant.gemm: fp8`` where ``torch._scaled_mm`` cannot run (a GPU before sm89, a torch without it):
    stop before the model is loaded, naming the setting (``auto`` picks what runs, at the first forward)."""
    quant = (cfg.get("model") or {}).get("quant") or {}
    if quant.get("gemm") != "fp8":
        return
    import torch

    from qat_app.hif8.gemm import resolve_gemm

    accelerator = str(cfg.trainer.get("accelerator") or "auto")
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    with settings_of("model.quant"):
        resolve_gemm("fp8", "cuda" if cuda else "cpu")


def derive_gradient_accumulation(cfg) -> None:
    """``data.global_batch_size`` -> ``trainer.accumulate_grad_batches`` for the micro-batch and the devices
    (refused when the global batch is no multiple of micro-batch x devices)."""
    data_args = cfg.get("data", {}).get("init_args", {}) or {}
    global_batch = data_args.get("global_batch_size")
    if global_batch:
        from qat_app.data.batching import derive_accumulate_grad_batches

        cfg.trainer.accumulate_grad_batches = derive_accumulate_grad_batches(
            global_batch, data_args.get("micro_batch_size"), world_size(cfg.trainer)
        )


def derive_validation_interval(cfg) -> None:
    """``val_every_n_steps`` (optimizer steps, the same on any number of devices) -> Lightning's
    ``trainer.val_check_interval`` (micro-batches): ``val_every_n_steps x trainer.accumulate_grad_batches``, after
    :func:`derive_gradient_accumulation`. It replaces a configured ``val_check_interval`` (a saved config holds the
    one derived for its own device count); one given alone keeps counting micro-batches, and the log says what
    that is in optimizer steps here."""
    every = cfg.get("val_every_n_steps")
    trainer_cfg = cfg.trainer
    accumulate = int(trainer_cfg.get("accumulate_grad_batches") or 1)
    configured = trainer_cfg.get("val_check_interval")
    if every is None:
        if isinstance(configured, int) and not isinstance(configured, bool) and accumulate > 1:
            log.info("trainer.val_check_interval=%d counts micro-batches: validation every %g optimizer steps with "
                     "%d micro-batches a step on these devices (val_every_n_steps states optimizer steps on any "
                     "number of devices)", configured, configured / accumulate, accumulate)
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"val_every_n_steps must be a positive integer (optimizer steps), got {every!r}")
    interval = every * accumulate
    if configured not in (None, 1.0, interval):
        log.warning("trainer.val_check_interval=%s replaced by val_every_n_steps=%d x %d micro-batches a step = %d "
                    "(to count micro-batches instead: --val_every_n_steps null)", configured, every, accumulate,
                    interval)
    trainer_cfg.val_check_interval = interval
    # an interval in batches across epochs (the pretraining stream has no epochs to count)
    trainer_cfg.check_val_every_n_epoch = None
    log.info("validation every %d optimizer steps = every %d micro-batches (%d a step on %d device(s))", every,
             interval, accumulate, world_size(trainer_cfg))


def check_fit_settings(cfg) -> None:
    """Settings that only make sense together, checked before the model is loaded: the BF16 warmup fits in
    ``trainer.max_steps``, so does the fallback window, and the LR schedule has the length it needs."""
    from callbacks.fallback import check_fallback, make_policy
    from callbacks.warmup import check_warmup_fits
    from qat_app.module import check_lr_schedule

    max_steps = cfg.trainer.get("max_steps")
    max_steps = -1 if max_steps is None else int(max_steps)
    if max_steps > 0:
        check_warmup_fits(int(cfg.warmup.warmup_steps), max_steps)
    fallback = cfg.get("fallback")
    if fallback is not None and fallback.get("enabled"):
        check_fallback(make_policy(fallback.get("policy")), warmup_steps=int(cfg.warmup.warmup_steps),
                       max_steps=max_steps, health=bool((cfg.get("saturation") or {}).get("health", True)))
    check_lr_schedule((cfg.get("model") or {}).get("lr_schedule", "cosine"), max_steps)


def route_limit_val_batches(cfg) -> None:
    """``trainer.limit_val_batches`` limits the held-out LM validation only. Lightning applies its one limit to every
    validation dataloader, the benchmarks' too (MMLU, ordered subject by subject, would lose its last subjects), so a
    limit other than 0 (validation off, which stays) moves to ``data.init_args.limit_val_batches`` of a
    :class:`~qat_app.data.pretrain.PretrainDataModule` (its LM loader alone) and the trainer's goes back to all
    batches. A :class:`~qat_app.data.benchmarks.BenchmarkDataModule` has no LM validation: its limit (and
    ``limit_test_batches``) is dropped, and every selected example is scored."""
    from qat_app.data.benchmarks import BenchmarkDataModule
    from qat_app.data.pretrain import PretrainDataModule

    data = cfg.get("data")
    data_class = _data_class(data)
    if data_class is None:
        return
    trainer_cfg = cfg.trainer
    for name in ("limit_val_batches", "limit_test_batches"):
        limit = trainer_cfg.get(name)
        if limit is None or limit == 0 or (isinstance(limit, float) and limit == 1.0):
            continue
        if issubclass(data_class, PretrainDataModule) and name == "limit_val_batches":
            given = data.init_args.get("limit_val_batches")
            if given is not None and given != limit:
                raise ConfigError(f"trainer.limit_val_batches={limit} and data.init_args.limit_val_batches={given}: "
                                  "both limit the held-out LM validation; set one")
            data.init_args.limit_val_batches = limit
            log.info("trainer.limit_val_batches=%s limits the held-out LM validation only "
                     "(data.init_args.limit_val_batches); every selected benchmark example is scored", limit)
        elif issubclass(data_class, BenchmarkDataModule):
            log.info("trainer.%s=%s not applied: this data has no held-out LM validation, and every selected "
                     "benchmark example is scored", name, limit)
        else:
            continue
        setattr(trainer_cfg, name, None)


def _data_class(data):
    """The class a ``data`` config section names (None when it names none, or one that does not import)."""
    import importlib

    class_path = data.get("class_path") if data is not None and hasattr(data, "get") else None
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def check_data(datamodule, world_size: int) -> None:
    """The datamodule's own input check (files, splits, enough data for the devices), when it has one."""
    check = getattr(datamodule, "check_inputs", None)
    if check is not None:
        check(world_size)


def check_forgetting_monitor(trainer, datamodule) -> None:
    """``forgetting.enabled`` / ``tasks`` against the initial evaluation and the benchmarks (callbacks.forgetting)."""
    from callbacks import ForgettingMonitor, InitialEvaluationCallback

    monitor = next((c for c in trainer.callbacks if isinstance(c, ForgettingMonitor)), None)
    if monitor is not None:
        initial = next((c for c in trainer.callbacks if isinstance(c, InitialEvaluationCallback)), None)
        monitor.check(initial, datamodule, trainer.limit_val_batches)


def check_fallback_policy(trainer, model) -> None:
    """``fallback.policy`` against the run (window, health, the format's reachable SQNR) before anything is written."""
    from callbacks import FallbackCallback

    fallback = next((c for c in trainer.callbacks if isinstance(c, FallbackCallback)), None)
    if fallback is not None:
        fallback.check(trainer, model)


def refuse_quantized_model_without_history(model, subcommand: str) -> None:
    """Evaluating (``subcommand``) a freshly quantized model: it has no amax history, so every layer would scale
    each batch by that padded batch's own max and scores would depend on the batch size. Refuse, saying what
    to do instead."""
    from qat_app.hif8.patch import quantized_linears

    layers = quantized_linears(model)
    delayed = [s for _, layer in layers for s in layer.scalers() if s.algo != "current"]
    if delayed and any(s.uses_current_scaling for s in delayed):
        raise ConfigError(
            f"{subcommand}: model.quant.enabled=true but the {len(layers)} quantized layers have no amax "
            "history yet (a model that was never trained with QAT), so each batch would be scaled by its own "
            "max and the scores would depend on the batch size. Evaluate the unquantized model with "
            "--model.quant.enabled false, or a QAT run with --ckpt_path <its checkpoint>"
        )
