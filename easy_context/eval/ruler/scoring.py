"""Scoring as RULER's harness does it, and the task x length tables.

RULER (scripts/eval/synthetic/constants.py and evaluate.py), over predictions p_i and
reference lists R_i, after each prediction is post-processed:

    postprocess(p)          = re.sub(r"[\\x00-\\x1f]", "\\n", p).strip()
    string_match_all(P, R)  = 100 * mean_i ( sum_{r in R_i} [lower(r) in lower(p_i)] / |R_i| )
    string_match_part(P, R) = 100 * mean_i ( max_{r in R_i} [lower(r) in lower(p_i)] )

string_match_all is the metric of every synthetic task (niah, vt, cwe, fwe; kv too);
string_match_part is RULER's metric for its QA tasks (any reference counts), kept here for a
task that takes it. A sample's own score is the term inside the mean (0 to 1); a cell's score
is the mean over its samples x 100; an average is the plain mean of the cells it spans
(every task weighs the same, as in RULER's tables).
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """Control characters (newlines and tabs among them) become newlines; ends stripped."""
    return _CONTROL.sub("\n", prediction).strip()


def match_all(prediction: str, references: list[str]) -> float:
    """The fraction of references found (case-insensitive substring) in the prediction."""
    found = prediction.lower()
    return sum(r.lower() in found for r in references) / len(references)


def match_part(prediction: str, references: list[str]) -> float:
    """1.0 when any reference is found in the prediction, else 0.0."""
    found = prediction.lower()
    return float(any(r.lower() in found for r in references))


METRICS = {"string_match_all": match_all, "string_match_part": match_part}


def score_sample(prediction: str, references: list[str], metric: str) -> float:
    """One sample's score (0 to 1) on its post-processed prediction."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; metrics: {', '.join(METRICS)}")
    return METRICS[metric](postprocess(prediction), references)


def string_match_all(predictions: list[str], references: list[list[str]]) -> float:
    """RULER's string_match_all over samples, x100."""
    return 100 * sum(match_all(postprocess(p), r)
                     for p, r in zip(predictions, references, strict=True)) / len(predictions)


def string_match_part(predictions: list[str], references: list[list[str]]) -> float:
    """RULER's string_match_part over samples, x100."""
    return 100 * sum(match_part(postprocess(p), r)
                     for p, r in zip(predictions, references, strict=True)) / len(predictions)


def score_rows(records: list[dict], tasks: list[str], lengths: list[int],
               num_samples: int) -> list[dict]:
    """One row per task x length: {task, length, score (x100), samples, metric}, from the
    sample records (fields task, length, index, score, metric) with index < num_samples;
    records of other tasks, lengths or indices (an earlier, larger run) are left out."""
    cells: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        if r["index"] < num_samples:
            cells[(r["task"], r["length"])].append(r)
    rows = []
    for task in tasks:
        for length in lengths:
            done = cells.get((task, length), [])
            if len(done) != num_samples:
                raise ValueError(f"{task} at {length}: {len(done)} of {num_samples} samples "
                                 "scored; rerun to finish them")
            rows.append({"task": task, "length": length,
                         "score": round(100 * sum(r["score"] for r in done) / len(done), 4),
                         "samples": len(done), "metric": done[0]["metric"]})
    return rows


def read_scores_csv(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{**row, "length": int(row["length"]), "score": float(row["score"])}
                for row in csv.DictReader(f)]


def write_scores_csv(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "length", "score", "samples", "metric"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown_table(rows: list[dict]) -> str:
    """Tasks down, lengths across, scores x100 with 2 decimals; an ``average`` column (each
    task over the lengths) and an ``average`` row (each length over the tasks)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    score = {(r["task"], r["length"]): r["score"] for r in rows}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    lines = ["| task | " + " | ".join(map(str, lengths)) + " | average |",
             "|---" * (len(lengths) + 2) + "|"]
    for task in tasks:
        values = [score[(task, n)] for n in lengths]
        lines.append(f"| {task} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {mean(values):.2f} |")
    columns = [mean([score[(t, n)] for t in tasks]) for n in lengths]
    lines.append("| average | " + " | ".join(f"{v:.2f}" for v in columns)
                 + f" | {mean(columns):.2f} |")
    return "\n".join(lines) + "\n"
