"""The fallback decisions grouped for a person: per symptom and remedy, how many tensors, which blocks and operands,
when, and what the verification found. The run summary prints these few lines; the full list stays in
``saturation_summary.json`` and the report.
"""

from __future__ import annotations

from collections import Counter

from .fallback import pending_verification
from .fallback_targets import TARGET_TEXT
from .headroom import block_of
from .operand import Operand
from .inventory import block_ranges
from .recipe import DEFAULT_BLOCK_PATTERN

MAX_GROUP_LINES = 4  # with the header and the budget's stop: at most 6 lines


def _tensor(entry: dict) -> str:
    return entry.get("tensor") or f"{entry['module']}.{entry['operand']}"


def group_decisions(entries: list[dict], block_pattern: str = DEFAULT_BLOCK_PATTERN) -> list[dict]:
    """One group per (reason, target), largest first: count, blocks, operand kinds, steps, verdicts."""
    groups: dict[tuple, dict] = {}
    for entry in entries:
        group = groups.setdefault((entry["reason"], entry["target"]), {
            "reason": entry["reason"], "target": entry["target"], "count": 0, "blocks": [], "operands": Counter(),
            "steps": [], "worked": 0, "did_not_work": 0, "pending": 0})
        group["count"] += 1
        block = block_of(_tensor(entry), block_pattern)
        if block is not None:
            group["blocks"].append(block)
        group["operands"][entry.get("operand") or Operand.of_tensor(_tensor(entry))[1]] += 1
        group["steps"].append(int(entry["step"]))
        verified = entry.get("verified")
        key = "pending" if pending_verification(entry) else ("worked" if verified["worked"] else "did_not_work")
        group[key] += 1
    return sorted(groups.values(), key=lambda g: (-g["count"], g["reason"], g["target"]))


def _group_line(group: dict) -> str:
    steps = sorted(group["steps"])
    when = f"step {steps[0]}" if steps[0] == steps[-1] else f"steps {steps[0]}-{steps[-1]}"
    blocks = sorted(set(group["blocks"]))
    where = f"block{'s' if len(blocks) > 1 else ''} {block_ranges(blocks)}; " if blocks else ""
    operands = ", ".join(f"{kind} {n}" for kind, n in sorted(group["operands"].items()))
    verdicts = [f"{group[k]} {text}" for k, text in (("worked", "worked"), ("did_not_work", "DID NOT WORK"),
                                                      ("pending", "pending")) if group[k]]
    return (f"{group['count']} {group['reason']} -> {TARGET_TEXT.get(group['target'], group['target'])} "
            f"({where}{operands}; {when}): {', '.join(verdicts)}")


def summary_lines(entries: list[dict], stopped: dict | None = None, prefix: str = "fallback      ",
                  indent: str = "              ", block_pattern: str = DEFAULT_BLOCK_PATTERN) -> list[str]:
    """At most 6 lines: the decisions per symptom and remedy, and the budget's stop with its diagnosis."""
    if not entries and stopped is None:
        return []
    groups = group_decisions(entries, block_pattern)
    lines = [f"{prefix}{len(entries)} tensors fell back"
             + (f" ({len(groups)} kind{'s' if len(groups) > 1 else ''}; every decision in saturation_summary.json)"
                if entries else "")]
    shown = groups[:MAX_GROUP_LINES] if len(groups) <= MAX_GROUP_LINES else groups[:MAX_GROUP_LINES - 1]
    lines += [indent + _group_line(g) for g in shown]
    if len(shown) < len(groups):
        rest = groups[len(shown):]
        lines.append(f"{indent}{sum(g['count'] for g in rest)} more in {len(rest)} other kinds")
    if stopped is not None:
        lines.append(f"{indent}stopped at step {stopped.get('step', '?')}: {stopped['qualified']} more qualified at once, "
                     f"past the budget of {stopped['budget']} (fallback.policy.max_tensors): the recipe, not a few "
                     f"tensors, is the problem: {stopped['diagnosis']}")
    return lines
