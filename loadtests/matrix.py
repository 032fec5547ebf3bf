"""Runs a benchmark's targets at each load, one after the other, keeping every result on disk as it comes."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def chosen_targets(parser: argparse.ArgumentParser, named: str, known: Sequence[str]) -> list[str]:
    """The comma-separated `named` targets, checked against `known` and against what is installed."""
    targets = named.split(",")
    if unknown := [t for t in targets if t not in known]:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if "haproxy" in targets and shutil.which("haproxy") is None:
        parser.error("the haproxy target needs HAProxy: apt-get install haproxy")
    return targets


def results_path(name: str) -> Path:
    out = Path(__file__).parent / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    return out


def run_matrix(
    report: dict[str, Any],
    out: Path,
    loads: Sequence[float],
    targets: Sequence[str],
    run_one: Callable[[str, float], Result],
    table: Callable[[list[Result]], str],
) -> None:
    """Run each target at each load into `report["results"]`, saved to `out` after every run; a
    target that fails is recorded as its error, and the others still run."""
    for load in loads:
        for target in targets:
            try:
                result = run_one(target, load)
            except Exception as error:  # one target's failure must not lose the others' results
                error_text = f"{type(error).__name__}: {str(error)[:300]}"
                result = {"target": target, "load": load, "error": error_text}
            report["results"].append(result)
            out.write_text(json.dumps(report, indent=1))
            print(table([result]).splitlines()[-1], flush=True)
    print(table(report["results"]))


def result_table(
    results: Sequence[Result], columns: Sequence[str], cell: Callable[[Result, str], Any]
) -> str:
    """Results as right-aligned columns; a failed run shows its error in place of its values."""
    rows = [tuple(columns)]
    for r in results:
        if "error" in r:
            rows.append((r["target"], str(r["load"]), r["error"][:60], *[""] * (len(columns) - 3)))
        else:
            rows.append(tuple(str(cell(r, c)) for c in columns))
    widths = [max(len(row[k]) for row in rows) for k in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows)
