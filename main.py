"""Command line: ``python main.py {fit,validate,test} --config configs/<experiment>.yaml [--flags]``.

Every constructor argument is a flag, e.g. ``--model.quant.amax_algo most_recent``,
``--model.quant.history_len 30``, ``--model.lr 1e-4``, ``--data.global_batch_size 256``.
``python main.py report ...`` builds the paper-style results table and figures from run logs.
"""

from __future__ import annotations

import logging
import os
import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

from callbacks import AmaxSaturationCallback, BF16WarmupCallback, TokenThroughputMonitor
from qat_app.module import QATModule


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


class QATCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # Always-on callbacks, configured as top-level sections: --warmup.warmup_steps 500 etc.
        parser.add_lightning_class_args(BF16WarmupCallback, "warmup")
        parser.add_lightning_class_args(AmaxSaturationCallback, "saturation")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        # the data reads text with the model's own tokenizer
        parser.link_arguments("model.model_name", "data.init_args.tokenizer")
        parser.link_arguments("model.trust_remote_code", "data.init_args.trust_remote_code")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        data_args = cfg.get("data", {}).get("init_args", {}) or {}
        global_batch = data_args.get("global_batch_size")
        if global_batch:
            from qat_app.data.pretrain import derive_accumulate_grad_batches

            cfg.trainer.accumulate_grad_batches = derive_accumulate_grad_batches(
                global_batch, data_args.get("micro_batch_size"), _world_size(cfg.trainer)
            )


def cli_main(args: list[str] | None = None) -> QATCLI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return QATCLI(
        QATModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from qat_app.report import main as report_main

        report_main(argv[1:])
        return
    cli_main(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
