"""Benchmark figures: each measured quantity over the rounds, and the Markdown table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Figure:
    """One measured quantity of one contender over the rounds."""

    scenario: str
    contender: str
    metric: str
    unit: str
    values: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

        return {
            "scenario": self.scenario,
            "contender": self.contender,
            "metric": self.metric,
            "unit": self.unit,
            "rounds": len(self.values),
            "values": self.values,
            "value": stats(self.values),
            "ratio": stats(self.ratios),
            "note": self.note,
        }


class Report:
    def __init__(self) -> None:
        self.figures: dict[tuple[str, str, str], Figure] = {}

    def add(
        self,
        scenario: str,
        contender: str,
        metric: str,
        unit: str,
        value: float,
        ratio: float | None = None,
        note: str = "",
    ) -> None:
        key = (scenario, contender, metric)
        figure = self.figures.setdefault(key, Figure(scenario, contender, metric, unit, note=note))
        figure.values.append(value)
        if ratio is not None:
            figure.ratios.append(ratio)
        if note:
            figure.note = note

    def markdown(self) -> str:
        lines = [
            "| Scenario | Contender | Metric | Median | Min-max "
            "| Ratio to baseline (median, min-max) | Rounds | Note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for figure in self.figures.values():
            s = figure.summary()
            v, r = s["value"], s["ratio"]
            value = _fmt(v["median"]) if v else "—"
            spread = f"{_fmt(v['min'])}-{_fmt(v['max'])}" if v else "—"
            ratio = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "—"
            lines.append(
                f"| {figure.scenario} | {figure.contender} | {figure.metric} ({figure.unit}) | "
                f"{value} | {spread} | {ratio} | {s['rounds']} | {figure.note} |"
            )
        return "\n".join(lines)


def _fmt(x: float) -> str:
    if x == float("inf"):
        return "∞"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.4f}"


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
