"""Command line: ``python main.py {fit,validate,test,report,export} ...`` (or the ``hif8-qat`` console script).

``fit`` / ``validate`` / ``test`` are LightningCLI's: ``--config configs/<experiment>.yaml [--flags]``, where every
constructor argument is a flag, e.g. ``--model.quant.amax_algo most_recent``, ``--model.quant.history_len 30``,
``--model.lr 1e-4``, ``--data.global_batch_size 256``. The extra subcommands (:data:`EXTRA_COMMANDS`) are plain
argparse programs: ``report`` builds the paper-style results table and figures from run logs
(:mod:`qat_app.report`), ``export`` writes an 8-bit HiF8 or a plain HF export of a checkpoint
(:mod:`qat_app.export`, also ``python -m qat_app.export``).

Start-up checks (before anything is written): the settings (:class:`qat_app.errors.ConfigError` naming the
field), and with ``--ckpt_path PATH|last`` the checkpoint (:mod:`qat_app.checkpoint`: ``last`` is resolved
to the ModelCheckpoint's newest ``last.ckpt``, a truncated or foreign file is refused). ``python main.py``
prints such errors, bad data (:class:`qat_app.data.pretrain.DataError`) and a run stopped by non-finite
steps as one ``error: ...`` line (``QAT_APP_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from callbacks import (AmaxSaturationCallback, BF16WarmupCallback, InitialEvaluationCallback, RNGStateCallback,
                       RunSummaryCallback, StepLogCallback, StepProgressBar, TokenThroughputMonitor)
from qat_app.errors import ConfigError, QATError, did_you_mean
from qat_app.module import QATModule

log = logging.getLogger("qat_app.cli")


def _world_size(trainer_cfg) -> int:
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


def _is_checkpoint_file_arg(ckpt_path) -> bool:
    return bool(ckpt_path) and str(ckpt_path) not in ("last", "best", "hpc") and not str(ckpt_path).startswith("registry")


def _as_dict(value) -> dict:
    if value is None:
        return {}
    return value.as_dict() if hasattr(value, "as_dict") else dict(value)


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
            wanted = _world_size({"devices": devices, "accelerator": accelerator})
            if wanted > visible:
                raise ConfigError(f"trainer.devices={devices}: this machine has {visible} visible GPU(s)")
    if str(getattr(strategy, "class_path", strategy)).rsplit(".", 1)[-1] in ("ModelParallelStrategy", "model_parallel"):
        init = (strategy.get("init_args") if hasattr(strategy, "get") else None) or {}
        world = _world_size(trainer_cfg)
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


def _user_error_in_chain(err: BaseException) -> BaseException | None:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (QATError, FileNotFoundError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class QATCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # Always-on callbacks, configured as top-level sections: --warmup.warmup_steps 500 etc.
        parser.add_lightning_class_args(BF16WarmupCallback, "warmup")
        parser.add_lightning_class_args(AmaxSaturationCallback, "saturation")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        parser.add_lightning_class_args(StepLogCallback, "step_log")
        parser.add_lightning_class_args(InitialEvaluationCallback, "initial_eval")
        # after "saturation": its on_fit_end writes the totals the summary reads
        parser.add_lightning_class_args(RunSummaryCallback, "summary")
        parser.add_argument(
            "--run_dir", type=Optional[str], default=None,
            help="put the whole run in DIR: trainer.default_root_dir and every logger save_dir / callback dirpath "
                 "under it are moved from the configured default_root_dir to DIR (one flag per run, as "
                 "`main.py study` does)")
        # the data reads text with the model's own tokenizer
        parser.link_arguments("model.model_name", "data.init_args.tokenizer")
        parser.link_arguments("model.trust_remote_code", "data.init_args.trust_remote_code")

    def parse_arguments(self, parser, args) -> None:
        """jsonargparse's errors (a page of union subtypes and raw values) become one line naming the field."""
        import argparse

        from qat_app.cli_errors import explain_argument_error

        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            argv = list(sys.argv[1:] if args is None else args)
            subcommand = next((a for a in argv if a in self.subcommands()), None)
            subparsers = getattr(getattr(parser, "_subcommands_action", None), "_name_parser_map", {})
            raise ConfigError(explain_argument_error(str(err), argv, subparsers.get(subcommand, parser))) from None

    def _instantiate_trainer(self, config: dict, callbacks: list) -> L.Trainer:
        """Add the default :class:`StepProgressBar` where Lightning would add its own bar: not next to a
        progress bar of the user's (Lightning refuses two) nor with ``enable_progress_bar: false``."""
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        if config.get("enable_progress_bar") is not False and not any(
                isinstance(c, ProgressBar) for c in [*given, *callbacks]):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _parse_ckpt_path(self) -> None:
        """Check an explicit ``--ckpt_path`` file before anything is built from it.

        ``fit`` resumes the saved run: the configured settings are kept and compared with the checkpoint's in
        :meth:`before_fit` (a changed model, data or warmup setting is refused, as with ``--ckpt_path last``).
        ``validate`` / ``test`` evaluate the saved model: as in Lightning 2.6, the checkpoint's ``model.*``
        settings replace the configured ones (the replaced values are logged).
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not _is_checkpoint_file_arg(ckpt_path):
            return super()._parse_ckpt_path()
        from qat_app.checkpoint import check_checkpoint_file, hparam_differences

        check_checkpoint_file(
            str(ckpt_path), weights_only=self.config[subcommand].get("weights_only"),
            need_training_state=subcommand == "fit", module_class=QATModule,
        )
        if subcommand == "fit":
            return
        before = _as_dict(self.config[subcommand].get("model"))
        super()._parse_ckpt_path()
        changed = hparam_differences(before, _as_dict(self.config[subcommand].get("model")))
        if changed:
            log.warning("--ckpt_path %s: the checkpoint's model settings replace the configured ones "
                        "(configured -> checkpoint): %s", ckpt_path, "; ".join(changed))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:
            # jsonargparse reports a failing datamodule constructor as "Does not validate against any of the
            # Union subtypes ..."; surface our own error (naming the field) from the exception chain
            cause = _user_error_in_chain(err)
            if cause is None or cause is err:
                raise
            raise cause.with_traceback(cause.__traceback__) from None

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("run_dir"):
            relocate_run(cfg.trainer, cfg.run_dir)
        check_accelerator(cfg.trainer)
        model = cfg.get("model") or {}
        if model.get("model_name") is not None:
            from qat_app.models import check_model_source, resolve_dtype

            check_model_source(model.get("model_name"), model.get("gguf_file"))
            resolve_dtype(model.get("dtype", "float32"))
        data_args = cfg.get("data", {}).get("init_args", {}) or {}
        global_batch = data_args.get("global_batch_size")
        if global_batch:
            from qat_app.data.pretrain import derive_accumulate_grad_batches

            cfg.trainer.accumulate_grad_batches = derive_accumulate_grad_batches(
                global_batch, data_args.get("micro_batch_size"), _world_size(cfg.trainer)
            )
        if self.subcommand == "fit":
            self._check_fit_settings(cfg)

    @staticmethod
    def _check_fit_settings(cfg) -> None:
        """Settings that only make sense together, checked before the model is loaded."""
        from callbacks.warmup import check_warmup_fits

        max_steps = cfg.trainer.get("max_steps")
        max_steps = -1 if max_steps is None else int(max_steps)
        model = cfg.get("model") or {}
        if max_steps > 0:
            check_warmup_fits(int(cfg.warmup.warmup_steps), max_steps)
        elif model.get("lr_schedule", "cosine") == "cosine":
            raise ConfigError(
                "model.lr_schedule=cosine needs trainer.max_steps > 0 (the length of the decay), got "
                f"trainer.max_steps={max_steps}; set it, or use model.lr_schedule=constant"
            )

    def before_fit(self) -> None:
        """Resolve and check ``--ckpt_path`` and the data before the trainer writes anything (config, logs,
        checkpoints)."""
        self._check_ckpt_path(need_training_state=True)
        self._check_data()

    def _check_data(self) -> None:
        check = getattr(self.datamodule, "check_inputs", None)
        if check is not None:
            check(self.trainer.world_size)

    def before_validate(self) -> None:
        self._check_ckpt_path(need_training_state=False)
        self._check_data()
        if self.config_init[self.subcommand].get("ckpt_path") is None:
            self._refuse_quantized_model_without_history()

    def _refuse_quantized_model_without_history(self) -> None:
        """A freshly quantized model has no amax history: every layer would scale each batch by that padded
        batch's own max, so scores would depend on the batch size. Refuse, saying what to do instead."""
        from qat_app.hif8.patch import quantized_linears

        layers = quantized_linears(self.model)
        delayed = [s for _, layer in layers for s in layer.scalers() if s.algo != "current"]
        if delayed and any(s.uses_current_scaling for s in delayed):
            raise ConfigError(
                f"{self.subcommand}: model.quant.enabled=true but the {len(layers)} quantized layers have no amax "
                "history yet (a model that was never trained with QAT), so each batch would be scaled by its own "
                "max and the scores would depend on the batch size. Evaluate the unquantized model with "
                "--model.quant.enabled false, or a QAT run with --ckpt_path <its checkpoint>"
            )

    before_test = before_validate

    def _check_ckpt_path(self, need_training_state: bool) -> None:
        from qat_app.checkpoint import checkpoint_dirs, newest_intact_checkpoint, validate_resume_checkpoint
        from qat_app.errors import CheckpointError

        cfg = self.config_init[self.subcommand]
        ckpt_path = cfg.get("ckpt_path")
        if ckpt_path != "last" and not _is_checkpoint_file_arg(ckpt_path):
            return
        weights_only = cfg.get("weights_only")
        run = dict(datamodule=self.datamodule, warmup=next(
            (cb for cb in self.trainer.callbacks if isinstance(cb, BF16WarmupCallback)), None))
        if str(ckpt_path) == "last":
            ckpt_path, summary, refused = newest_intact_checkpoint(self.trainer, self.model, weights_only,
                                                                    need_training_state, **run)
            for path, why in refused:
                log.warning("--ckpt_path last: skipping %s: %s", path, why)
            if ckpt_path is None:
                if refused:  # checkpoints exist but none can resume this run: say why, do not start over
                    raise CheckpointError(
                        f"--ckpt_path last: no checkpoint in {checkpoint_dirs(self.trainer)} can resume this run; "
                        f"the newest: {refused[0][1]}")
                log.warning("--ckpt_path last: no last checkpoint in %s; starting a new run",
                            checkpoint_dirs(self.trainer) or "the ModelCheckpoint directory")
                cfg["ckpt_path"] = None
                return
            log.info("--ckpt_path last: resuming from %s%s", ckpt_path,
                     f" (the newest intact checkpoint; {len(refused)} newer refused)" if refused else "")
        else:
            ckpt_path = str(ckpt_path)
            summary = validate_resume_checkpoint(ckpt_path, self.model, weights_only=weights_only,
                                                 need_training_state=need_training_state, trainer=self.trainer, **run)
        if need_training_state:
            log.info("checkpoint %s (global step %s) checked: resuming", ckpt_path, summary["global_step"])
        cfg["ckpt_path"] = ckpt_path  # exactly the file that was checked


def cli_kwargs() -> dict:
    """The LightningCLI arguments of every entry point (the CLI, the study's parse-only check)."""
    return dict(
        model_class=QATModule,
        datamodule_class=L.LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False},  # errors reach QATCLI.parse_arguments, which explains them
        # always on, no settings: RNG states of every rank in checkpoints (exact resume)
        trainer_defaults={"callbacks": [RNGStateCallback()]},
    )


def cli_main(args: list[str] | None = None, run: bool = True) -> QATCLI:
    """``args=None`` reads ``sys.argv`` (a list: as if typed, for tests); ``run=False`` only builds model,
    data and trainer (no subcommand), as :mod:`tests.test_configs` does for every shipped config."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # datasets' file readers log a traceback before raising; the error is reported once, as DataError
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    return QATCLI(**cli_kwargs(), args=args, run=run)


# LightningCLI's subcommands (it also has ``predict``, which QATModule does not implement)
LIGHTNING_COMMANDS = ("fit", "validate", "test")
# the other subcommands: name -> (module with ``main(argv, prog=...) -> int | None``, one-line help)
EXTRA_COMMANDS = {
    "report": ("qat_app.report", "the paper's results table and figures from run logs"),
    "export": ("qat_app.export", "8-bit HiF8 (or plain HF) export of a QATModule checkpoint"),
    "study": ("qat_app.study", "run a study: the initial evaluation, every run of a study file, the reports"),
}


def _program() -> str:
    """How the user called us, for usage lines: the console script, else ``python main.py``."""
    return "hif8-qat" if sys.argv and os.path.basename(sys.argv[0]) == "hif8-qat" else "python main.py"


def usage(prog: str | None = None) -> str:
    prog = prog or _program()
    commands = [*LIGHTNING_COMMANDS, *EXTRA_COMMANDS]
    lines = [f"usage: {prog} {{{','.join(commands)}}} ...", "", "commands:"]
    lines += [f"  {name:<9} LightningCLI {name} (--config FILE, --help for every flag)" for name in LIGHTNING_COMMANDS]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in EXTRA_COMMANDS.items()]
    lines += ["", f"'{prog} COMMAND --help' shows the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``argv=None``: the command line (``python main.py ...``, ``hif8-qat ...``); a list: as if typed."""
    if argv is None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = sys.argv[1:] if argv is None else argv
    if not command or command[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if command else sys.stderr)
        sys.exit(0 if command else 2)
    if command[0] in EXTRA_COMMANDS:
        module = importlib.import_module(EXTRA_COMMANDS[command[0]][0])
        code = module.main(command[1:], prog=f"{_program()} {command[0]}")
        if code:
            sys.exit(code)
        return
    if not command[0].startswith("-") and command[0] not in LightningCLI.subcommands():
        print(usage(), file=sys.stderr)
        print(f"error: unknown command {command[0]!r} (choose from {', '.join([*LIGHTNING_COMMANDS, *EXTRA_COMMANDS])})",
              file=sys.stderr)
        sys.exit(2)
    try:
        # None from the command line: LightningCLI reads sys.argv itself (given a list, it warns that
        # args is meant for calls from within Python)
        cli_main(argv)
    except (QATError, FileNotFoundError) as err:  # the user's input or run, not a bug: no traceback
        if os.environ.get("QAT_APP_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))


if __name__ == "__main__":
    main()
