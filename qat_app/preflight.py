"""Pre-flight checks: settings a run cannot work with, refused before anything is built or written.

Each check raises :class:`qat_app.errors.ConfigError` (or the data's / the model source's own error) with one
line naming the setting; :class:`qat_app.cli.QATCLI` calls them in this order:

* on the parsed config, before the model is loaded: :func:`relocate_run` (``--run_dir``),
  :func:`check_accelerator`, :func:`check_model_settings`, :func:`derive_gradient_accumulation` (which also
  checks the batch arithmetic) and, for ``fit``, :func:`check_fit_settings`;
* on the built objects, before the trainer writes anything: :func:`check_data`, and for ``validate`` /
  ``test`` without a checkpoint :func:`refuse_quantized_model_without_history`.

The checkpoint given with ``--ckpt_path`` is checked by :mod:`qat_app.checkpoint` (the resume policy).
"""

from __future__ import annotations

import os

from qat_app.errors import ConfigError, did_you_mean, settings_of


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
