"""Command line: ``python main.py {fit,validate,test,report,export} ...`` (or the ``hif8-qat`` console script).

``fit`` / ``validate`` / ``test`` are LightningCLI's: ``--config configs/<experiment>.yaml [--flags]``, where every
constructor argument is a flag, e.g. ``--model.quant.amax_algo most_recent``, ``--model.quant.history_len 30``,
``--model.lr 1e-4``, ``--data.global_batch_size 256``. The extra subcommands (:data:`EXTRA_COMMANDS`) are plain
argparse programs: ``report`` builds the paper-style results table and figures from run logs
(:mod:`qat_app.report`), ``export`` writes an 8-bit HiF8, a plain HF or an FP8 serving export of a checkpoint
(:mod:`qat_app.export`, also ``python -m qat_app.export``), ``inspect`` ranks the quantized layers by the SQNR of
their HiF8 output against high precision (:mod:`qat_app.inspection`, with ``validate``'s model and data flags).

:class:`QATCLI` is the wiring: the arguments, the calls of the start-up checks (before anything is written)
and the translation of errors. The checks live elsewhere: the settings in :mod:`qat_app.preflight`
(:class:`qat_app.errors.ConfigError` naming the field), ``--ckpt_path PATH|last`` in :mod:`qat_app.checkpoint`
(``last`` is resolved to the run's newest intact checkpoint, a truncated or foreign file is refused). ``python main.py``
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
from docstring_parser import DocstringStyle
from jsonargparse import set_parsing_settings
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI

from callbacks import FallbackCallback, MemoryMonitor, NoiseFloorCallback, SpikeAlarm, TensorBoardDashboard
from callbacks import (AmaxSaturationCallback, BF16WarmupCallback, ForgettingMonitor, InitialEvaluationCallback,
                       QATModelSummary, QuantizedModulesCallback, RNGStateCallback, RunSummaryCallback, StepLogCallback,
                       StepProgressBar, TokenThroughputMonitor)
from qat_app import preflight
from qat_app.cli_errors import replace_deprecated_flags
from qat_app.checkpoint import (check_given_checkpoint, is_checkpoint_file_arg, log_replaced_settings, resolve_ckpt_path,
                                settings_dict)
from qat_app.errors import ConfigError, QATError
from qat_app.module import QATModule
from qat_app.quiet import quiet_library_notices
from qat_app.sharded_checkpoint import looks_sharded, sharded_hparams
from qat_app.step_profile import StepProfiler

log = logging.getLogger("qat_app.cli")

# Every --help line comes from the constructors' Google-style "Args:" (ours and Lightning's); docstring_parser's
# auto-detection takes ours for reStructuredText (they cite :class: roles) and finds no argument in them.
set_parsing_settings(docstring_parse_style=DocstringStyle.GOOGLE)


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
        parser.add_lightning_class_args(FallbackCallback, "fallback")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        parser.add_lightning_class_args(MemoryMonitor, "memory")
        parser.add_lightning_class_args(TensorBoardDashboard, "dashboard")
        parser.add_lightning_class_args(StepLogCallback, "step_log")
        parser.add_lightning_class_args(InitialEvaluationCallback, "initial_eval")
        # after "initial_eval": compares every later validation's benchmark records with the step-0 ones
        parser.add_lightning_class_args(ForgettingMonitor, "forgetting")
        # loss / gradient-norm spikes and non-finite steps, read once per optimizer step
        parser.add_lightning_class_args(SpikeAlarm, "alarms")
        # the W8A8 forward's noise floor, once at the end of a fit (before "summary", which prints it)
        parser.add_lightning_class_args(NoiseFloorCallback, "noise_floor")
        # after "saturation": its on_fit_end writes the totals the summary reads
        parser.add_lightning_class_args(RunSummaryCallback, "summary")
        # where a few optimizer steps' time goes (off by default); becomes the trainer's profiler
        parser.add_class_arguments(StepProfiler, "profile")
        parser.add_argument(
            "--run_dir", type=Optional[str], default=None,
            help="put the whole run in DIR: trainer.default_root_dir and every logger save_dir / callback dirpath "
                 "under it are moved from the configured default_root_dir to DIR (one flag per run, as "
                 "`main.py study` does)")
        parser.add_argument(
            "--val_every_n_steps", type=Optional[int], default=None,
            help="validate every N optimizer steps, the same on any number of devices and nodes: converted at start "
                 "to trainer.val_check_interval (micro-batches) = N x the gradient accumulation, which it replaces")
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

    # A private override: LightningCLI's public ``instantiate_trainer(**kwargs)`` can only replace the configured
    # callbacks, not append after the always-on sections above; the bar must run after them (it shows the
    # step's sat/* values, which "saturation" logs in the same on_train_batch_end hook).
    def _instantiate_trainer(self, config: dict, callbacks: list) -> L.Trainer:
        """Add our :class:`StepProgressBar` and :class:`QATModelSummary` where Lightning would add its own:
        not next to one of the user's (Lightning refuses two bars) nor when ``enable_progress_bar`` /
        ``enable_model_summary`` is false."""
        given = config.get("callbacks") or []
        given = [*(given if isinstance(given, list) else [given]), *callbacks]
        profiler = (self.config_init.get(self.subcommand) or {}).get("profile") if self.subcommand else None
        if isinstance(profiler, StepProfiler) and profiler.steps and self.subcommand == "fit":
            if config.get("profiler") is not None:
                raise ConfigError("profile.steps: trainer.profiler is set too; use one of them")
            config = {**config, "profiler": profiler}
        for kind, switch, default in ((ProgressBar, "enable_progress_bar", StepProgressBar),
                                      (ModelSummary, "enable_model_summary", QATModelSummary)):
            if config.get(switch) is not False and not any(isinstance(c, kind) for c in given):
                callbacks = [*callbacks, default()]
        return super()._instantiate_trainer(config, callbacks)

    # A private override: LightningCLI has no public hook between parsing and its own reading of a checkpoint
    # file's hyperparameters (an unchecked ``torch.load``: a truncated or foreign file would fail there with a
    # traceback, or configure the model); ``before_instantiate_classes`` comes after it.
    def _parse_ckpt_path(self) -> None:
        """Check an explicit ``--ckpt_path`` file before anything is built from it (the policy:
        :func:`qat_app.checkpoint.check_given_checkpoint`)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not is_checkpoint_file_arg(ckpt_path):
            return super()._parse_ckpt_path()
        weights_only = self.config[subcommand].get("weights_only")
        if not check_given_checkpoint(ckpt_path, subcommand, weights_only, module_class=QATModule):
            return
        if weights_only is False:  # Lightning reads the settings weights-only, which this file needs not to be
            log.warning("--ckpt_path %s: its model settings are not read (--weights_only false; Lightning reads them "
                        "weights-only): the configured ones are used", ckpt_path)
            return
        configured = settings_dict(self.config[subcommand].get("model"))
        if looks_sharded(str(ckpt_path)):  # Lightning reads a file's settings only; a sharded one's are in meta.pt
            hparams = {k: v for k, v in (sharded_hparams(str(ckpt_path)) or {}).items() if k != "_instantiator"}
            if hparams:
                self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        else:
            super()._parse_ckpt_path()
        model = self.config[subcommand].get("model")
        if model is not None and "trust_remote_code" in model:  # the user's choice, never a file's
            model.trust_remote_code = bool(configured.get("trust_remote_code", False))
        log_replaced_settings(ckpt_path, configured, settings_dict(self.config[subcommand].get("model")))

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
        """The settings (:mod:`qat_app.preflight`), before the model is loaded."""
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("run_dir"):
            preflight.relocate_run(cfg.trainer, cfg.run_dir)
        preflight.check_accelerator(cfg.trainer)
        preflight.check_model_settings(cfg.get("model"))
        preflight.check_gemm(cfg)
        preflight.derive_gradient_accumulation(cfg)
        preflight.derive_validation_interval(cfg)
        preflight.route_limit_val_batches(cfg)
        if self.subcommand == "fit":
            preflight.check_fit_settings(cfg)

    def before_fit(self) -> None:
        """Resolve and check ``--ckpt_path`` and the data before the trainer writes anything (config, logs,
        checkpoints)."""
        self._resolve_ckpt_path(need_training_state=True)
        preflight.check_data(self.datamodule, self.trainer.world_size)
        preflight.check_forgetting_monitor(self.trainer, self.datamodule)
        preflight.check_fallback_policy(self.trainer, self.model)

    def before_validate(self) -> None:
        self._resolve_ckpt_path(need_training_state=False)
        preflight.check_data(self.datamodule, self.trainer.world_size)
        if self.config_init[self.subcommand].get("ckpt_path") is None:
            preflight.refuse_quantized_model_without_history(self.model, self.subcommand)

    before_test = before_validate

    def _resolve_ckpt_path(self, need_training_state: bool) -> None:
        """``--ckpt_path`` becomes exactly the file that was checked (:func:`qat_app.checkpoint.resolve_ckpt_path`)."""
        cfg = self.config_init[self.subcommand]
        warmup = next((cb for cb in self.trainer.callbacks if isinstance(cb, BF16WarmupCallback)), None)
        cfg["ckpt_path"] = resolve_ckpt_path(cfg.get("ckpt_path"), self.trainer, self.model, need_training_state,
                                             cfg.get("weights_only"), datamodule=self.datamodule, warmup=warmup)


def cli_kwargs() -> dict:
    """The LightningCLI arguments of every entry point (the CLI, the study's parse-only check)."""
    return dict(
        model_class=QATModule,
        datamodule_class=L.LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False},  # errors reach QATCLI.parse_arguments, which explains them
        # always on, no settings: RNG states of every rank in checkpoints (exact resume); quantized_modules.json
        trainer_defaults={"callbacks": [RNGStateCallback(), QuantizedModulesCallback()]},
    )


def cli_main(args: list[str] | None = None, run: bool = True) -> QATCLI:
    """``args=None`` reads ``sys.argv`` (a list: as if typed, for tests); ``run=False`` only builds model,
    data and trainer (no subcommand), as :mod:`tests.test_configs` does for every shipped config."""
    configure_logging()
    return QATCLI(**cli_kwargs(), args=args, run=run)


def configure_logging() -> None:
    """The log format and the quieted libraries of the LightningCLI entry points (fit / validate / test, inspect)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # datasets' file readers log a traceback before raising; the error is reported once, as DataError
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    quiet_library_notices()


# LightningCLI's subcommands (it also has ``predict``, which QATModule does not implement)
LIGHTNING_COMMANDS = ("fit", "validate", "test")
# the other subcommands: name -> (module with ``main(argv, prog=...) -> int | None``, one-line help)
EXTRA_COMMANDS = {
    "report": ("qat_app.report", "the paper's results table and figures from run logs"),
    "export": ("qat_app.export", "8-bit HiF8, plain HF or FP8 (compressed-tensors, vLLM) export of a QATModule checkpoint"),
    "study": ("qat_app.study", "run a study: the initial evaluation, every run of a study file, the reports"),
    "inspect": ("qat_app.inspection", "per quantized layer, HiF8 vs high-precision output SQNR; what to keep in high precision"),
    "evaluate": ("qat_app.evaluate", "any lm-eval task on the exact W8A8 model of a checkpoint, paired against its initial model"),
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
        sys.argv[1:] = replace_deprecated_flags(sys.argv[1:])  # LightningCLI reads sys.argv itself
    command = sys.argv[1:] if argv is None else replace_deprecated_flags(argv)
    try:
        preflight.check_torch()
    except ConfigError as err:  # a torch outside the supported range: one line, before anything runs
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
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
        cli_main(None if argv is None else command)
    except (QATError, FileNotFoundError) as err:  # the user's input or run, not a bug: no traceback
        if os.environ.get("QAT_APP_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))


if __name__ == "__main__":
    main()
