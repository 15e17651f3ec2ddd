"""Figures from the files the evals write (never from inside an eval loop).

    plot_needle_heatmap("needle/results.json", "needle/heatmap.png")
    plot_ppl(["ppl.csv"], "ppl.png")      # one line per model
    plot_ruler("ruler/scores.csv", "ruler/scores.png")  # one line per task

matplotlib runs headless (Agg), so plotting works on a cluster node without a display.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

# The original's palette: red (0) -> yellow -> green (1).
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def plot_needle_heatmap(results_json: str | Path, output_png: str | Path,
                        title: str | None = None) -> Path:
    """Heatmap of a needle results file: x context length, y depth %, colour the score."""
    results = json.loads(Path(results_json).read_text())
    cells = results["cells"]
    if not cells:
        raise ValueError(f"{results_json} has no cells to plot")
    lengths = sorted({c["context_length"] for c in cells})
    depths = sorted({c["depth_percent"] for c in cells})
    grid = [[float("nan")] * len(lengths) for _ in depths]
    for c in cells:
        grid[depths.index(c["depth_percent"])][lengths.index(c["context_length"])] = c["score"]
    size = (max(6.0, 0.6 * len(lengths) + 3), max(4.0, 0.35 * len(depths) + 2))
    fig, ax = plt.subplots(figsize=size)
    image = ax.imshow(grid, cmap=NEEDLE_CMAP, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, label="Score")
    ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths], rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Depth percent")
    average = results.get("average_score")
    name = title or results.get("config", {}).get("model", "")
    ax.set_title(f"{name}  average {average:.3f}" if average is not None else name)
    return save_figure(fig, output_png)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a figure; returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _short(n: int) -> str:
    return f"{n // 1000}K" if n >= 10_000 and n % 1000 == 0 else str(n)


def read_ppl_csv(paths: list[str | Path],
                 column: str = "ppl") -> dict[str, list[tuple[int, float]]]:
    """{model: [(context length, value of ``column``), ...]} from one or more eval-ppl CSVs."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if column not in row:
                    raise ValueError(f"{path} has no column {column!r}; columns: {list(row)}")
                series[row["model"]].append((int(row["context_length"]), float(row[column])))
    if not series:
        raise ValueError(f"no rows in {[str(p) for p in paths]}")
    return {m: sorted(points) for m, points in series.items()}


def plot_ppl(csv_paths: list[str | Path], output_png: str | Path, column: str = "ppl",
             xmax: float | None = None, ymin: float | None = None,
             ymax: float | None = None) -> Path:
    """Perplexity (or ``last_k_ppl``) against context length, one line per model."""
    series = read_ppl_csv(csv_paths, column)
    fig, ax = plt.subplots(figsize=(8, 5))
    for model, points in series.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=model)
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Perplexity" if column == "ppl" else column.replace("_", " "))
    ax.set_xlim(right=xmax)
    ax.set_ylim(bottom=ymin, top=ymax)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, output_png)


def plot_ruler(scores_csv: str | Path, output_png: str | Path, title: str | None = None) -> Path:
    """RULER score (x100) against length from an eval-ruler scores.csv: one line per task,
    and their average as a thick black line."""
    from .ruler.scoring import read_scores_csv

    rows = read_scores_csv(scores_csv)
    if not rows:
        raise ValueError(f"{scores_csv} has no scores to plot")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    by_length: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        series[r["task"]].append((r["length"], r["score"]))
        by_length[r["length"]].append(r["score"])
    lengths = sorted(by_length)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.get_cmap("tab20").colors  # 12 tasks: the default cycle repeats after 10
    for i, (task, points) in enumerate(series.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", linewidth=1, alpha=0.85, color=colors[i % len(colors)],
                label=task)
    average = [sum(by_length[n]) / len(by_length[n]) for n in lengths]
    ax.plot(lengths, average, color="black", linewidth=2.5, marker="s", label="average")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [_short(n) for n in lengths])
    ax.set_xlabel("Length (tokens)")
    ax.set_ylabel("Score")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        ax.set_title(title)
    return save_figure(fig, output_png)
