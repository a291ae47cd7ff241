"""``main.py evaluate``'s results beside the in-loop benchmarks: each evaluation's paired table as markdown."""

from __future__ import annotations

import json
from pathlib import Path

from .runs import ReportError

EVALUATION_FILE = "evaluate.json"  # what `main.py evaluate` writes under its --output_path


def load_evaluation(directory) -> dict:
    path = Path(directory) / EVALUATION_FILE
    if not path.is_file():
        raise ReportError(f"--evaluations: {path} not found (the output of `main.py evaluate --output_path DIR`)")
    try:
        summary = json.loads(path.read_text())
        summary["paired"], summary["model"]  # noqa: B018 -- the fields the table needs
    except (ValueError, KeyError) as err:
        raise ReportError(f"--evaluations: {path} is not an evaluate summary ({err})") from None
    summary["directory"] = str(directory)
    return summary


def _paired_table(title: str, paired: list[dict], summed: dict | None, sides=("model", "baseline")) -> list[str]:
    lines = [title, "", f"| task | metric | {sides[0]} | {sides[1]} | difference [95 %] | p | n | noise floor | verdict |",
             "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for row in paired:
        floor = "-" if row["noise_floor"] is None else f"{row['noise_floor']:.4f}"
        metric = row["metric"] if row["filter"] in ("none", None) else f"{row['metric']} ({row['filter']})"
        lines.append(f"| {row['task']} | {metric} | {row['after']:.4f} | {row['before']:.4f} | {row['difference']:+.4f} "
                     f"[{row['low']:+.4f}, {row['high']:+.4f}] | {row['p_value']:.3g} | {row['n']} | {floor} | "
                     f"{row['verdict']} |")
    lines.append("")
    for metric, total in (summed or {}).items():
        if total is not None:
            floor = "" if total.get("noise_floor") is None else f", noise floor {total['noise_floor']:.4f}"
            verdict = f": {total['verdict']}" if total.get("verdict") else ""
            lines.append(f"- summed over tasks, {metric}: {total['difference']:+.4f} [{total['low']:+.4f}, "
                         f"{total['high']:+.4f}] ({total['n']} documents{floor}){verdict}")
    return lines


def render_evaluation(summary: dict) -> str:
    """One evaluation: model vs baseline per task and metric, the difference with its 95 % interval, p, n, the
    noise floor and the verdict; the differences summed over tasks; the generation drift; the served export
    against the model (``baseline`` there is the trained model)."""
    lines = _paired_table(f"### {summary['model']} against {summary['baseline']}", summary.get("paired") or [],
                          summary.get("summed")) if summary.get("paired") else []
    measures = summary.get("measures")
    if measures:
        names = sorted({m for results in measures.values() for m in results})
        lines += ["", "Continuous measures of the multiple-choice tasks (model - baseline; kl_choices: the mean KL of "
                  "the choice distributions), 95 % intervals:", "", "| task | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for task, results in measures.items():
            cells = [f"{r['difference']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}]" if r else "-"
                     for r in (results.get(m) for m in names)]
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
        lines.append("")
    drift = summary.get("generation_drift")
    if drift:
        kl = drift["kl"]
        lines.append(f"- generation drift KL(baseline || model): {kl['difference']:.5f} [{kl['low']:.5f}, "
                     f"{kl['high']:.5f}] nats/token over {drift['prompts']} prompts")
    served = summary.get("served")
    if served:
        lines += ["", *_paired_table(f"### {served['label']} against the trained model {summary['model']}",
                                     served["paired"], served["summed"], ("served", "trained"))]
        lines.append(f"- served linear kernels: {', '.join(sorted(set(served['kernels'].values()))) or 'not logged'}")
        for task, row in (served.get("logliks") or {}).items():
            lines.append(f"- {task}: {row['same_choice']}/{row['documents']} documents pick the same choice, largest "
                         f"|log-likelihood difference| {row['max_abs_diff']:.3g} ({row['identical']}/{row['requests']} "
                         "identical)")
    notes = sorted({note for note in (summary.get("data") or {}).values() if "not shipped" in note})
    lines += [f"- data: {note}" for note in notes]
    return "\n".join(lines)


def render_evaluations(summaries: list[dict]) -> str:
    if not summaries:
        return ""
    body = "\n\n".join(render_evaluation(s) for s in summaries if s.get("paired") or s.get("served"))
    return "\n\n## lm-eval tasks on the same models (`main.py evaluate`)\n\n" + body + "\n"
