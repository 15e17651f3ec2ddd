"""report.md and its figures, from the files the demo's steps wrote (summary.json,
timings.json, eval/*.json|csv, each stage's metrics.jsonl). Nothing is recomputed here."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..eval.plots import plot_needle_heatmap, plot_ppl, save_figure  # noqa: E402
from ..recipes.recipe import Recipe  # noqa: E402

ARTIFACTS = ("report.md", "needle_before.png", "needle_after.png", "ppl.png", "ppl_last_k.png",
             "loss.png", "stages.png", "summary.json", "timings.json",
             "eval/needle_before.json", "eval/needle_after.json", "eval/ppl_before.csv",
             "eval/ppl_after.csv", "eval/ruler_before/scores.csv",
             "eval/ruler_after/scores.csv", "eval/ruler_before/scores.png",
             "eval/ruler_after/scores.png")
TARGET_AFTER, TARGET_BEFORE = 0.8, 0.2


def _metrics(stage_dir: Path) -> list[dict]:
    path = stage_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def stage_rows(recipe: Recipe) -> list[dict]:
    """Per training stage: settings, and from its metrics.jsonl the final loss, the peak
    memory (max over steps) and the median tokens/s (the first step warms up)."""
    rows = []
    for stage in recipe.stages:
        t, m = stage.train, _metrics(stage.output_dir)
        rows.append({"stage": stage.name, "seq_length": t["seq_length"],
                     "rope_theta": t["rope_theta"], "method": t["parallel_mode"],
                     "ranks": t["nproc_per_node"], "steps": len(m),
                     "final_loss": m[-1]["loss"] if m else float("nan"),
                     "peak_memory_mb": max((x["peak_memory_mb"] for x in m
                                            if x["peak_memory_mb"] is not None), default=float("nan")),
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in m) if m else float("nan"),
                     "train_s": sum(x["step_time_s"] for x in m), "metrics": m})
    return rows


def plot_loss(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    offset = 0
    for row in rows:
        steps = [offset + x["step"] for x in row["metrics"]]
        ax.plot(steps, [x["loss"] for x in row["metrics"]], label=f"{row['stage']}")
        if offset:
            ax.axvline(offset + 0.5, color="grey", lw=0.8, ls="--")
        offset += row["steps"]
    ax.set_xlabel("optimizer step (all stages)")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def plot_stages(rows: list[dict], path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{r['seq_length']}\n{r['method'].replace('_attn', '')}" for r in rows]
    a.bar(names, [r["peak_memory_mb"] for r in rows], color="#4C72B0")
    a.set_ylabel("peak memory per rank (MB, RSS high-water)")
    b.bar(names, [r["tokens_per_s"] for r in rows], color="#55A868")
    b.set_ylabel("tokens/s (median step, all ranks)")
    for ax in (a, b):
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def _needle_by_length(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Means over depths of each length's ``score`` (exact match) and ``token_accuracy``."""
    cells = json.loads(path.read_text())["cells"]
    out: dict[int, list[tuple[float, float]]] = {}
    for c in cells:
        out.setdefault(c["context_length"], []).append((c["score"], c["token_accuracy"]))
    means = {n: [sum(x) / len(v) for x in zip(*v)] for n, v in sorted(out.items())}
    return {n: m[0] for n, m in means.items()}, {n: m[1] for n, m in means.items()}


def _ppl(path: Path) -> dict[int, dict]:
    with open(path, newline="") as f:
        return {int(r["context_length"]): {k: float(r[k]) for k in ("ppl", "last_k_ppl", "last_k")}
                for r in csv.DictReader(f)}


def _fmt(x: float, spec: str = ".3f") -> str:
    return "n/a" if x != x else format(x, spec)


def _ruler_lines(summary: dict) -> list[str]:
    """RULER's tasks before and after the extension: score (x100, RULER's string_match_all)
    per task and length, generated answers (easy_context.generate)."""
    before = {(r["task"], r["length"]): r for r in summary["evals"]["before"].get("ruler", [])}
    after = {(r["task"], r["length"]): r for r in summary["evals"]["after"].get("ruler", [])}
    if not before:
        return []
    lengths = sorted({n for _, n in before})
    tasks = list(dict.fromkeys(t for t, _ in before))
    samples = next(iter(before.values()))["samples"]
    lines = ["## RULER tasks by context length", "",
             f"Generated answers (greedy, `easy_context.generate`), scored as RULER scores them "
             f"(string_match_all, x100), {samples} sample(s) per cell; the prompts are RULER's "
             "wording, which this tiny model was never taught (its needles read "
             "'The KEY code=VALUE.'): a floor, not its retrieval ability (eval-ruler in "
             "docs/guides/evaluation.md says how these differ from RULER's own harness).", "",
             "| task | " + " | ".join(f"{n} before | {n} after" for n in lengths) + " |",
             "|---|" + "---:|---:|" * len(lengths)]
    for task in tasks:
        cells = [f"{before[(task, n)]['score']:.0f} | {after.get((task, n), {}).get('score', float('nan')):.0f}"
                 for n in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_report(out: Path, recipe: Recipe) -> Path:
    summary = json.loads((out / "summary.json").read_text())
    timings = json.loads((out / "timings.json").read_text())
    ev = out / "eval"
    rows = stage_rows(recipe)
    for label in ("before", "after"):
        plot_needle_heatmap(ev / f"needle_{label}.json", out / f"needle_{label}.png",
                            title=f"needle, {label} extension")
    plot_ppl([ev / "ppl_before.csv", ev / "ppl_after.csv"], out / "ppl.png")
    plot_ppl([ev / "ppl_before.csv", ev / "ppl_after.csv"], out / "ppl_last_k.png",
             column="last_k_ppl")
    plot_loss(rows, out / "loss.png")
    plot_stages(rows, out / "stages.png")

    (nb, tb), (na, ta) = (_needle_by_length(ev / f"needle_{x}.json") for x in ("before", "after"))
    pb, pa = _ppl(ev / "ppl_before.csv"), _ppl(ev / "ppl_after.csv")
    first = summary["first_length"]
    target_len = 4 * first
    extensions = sum((r["seq_length"], r["rope_theta"]) != (first, rows[0]["rope_theta"])
                     for r in rows)
    lines = [f"# EasyContext demo: {first} -> {rows[-1]['seq_length']} tokens on CPU", ""]
    if summary["quick"]:
        lines += ["**Quick run** (`--quick`, for CI): a few steps per stage, a coarse eval grid. "
                  "It produces every artifact; its numbers do not meet (and are not meant to "
                  "meet) the accuracy targets. Run `easy-context demo` for the real figures.", ""]
    lines += [
        f"A {_params(out)} Llama (byte-level BPE tokenizer "
        "trained on generated text) is trained at "
        f"{first} tokens with RoPE theta {rows[0]['rope_theta']:g} "
        f"({', '.join(r['stage'] for r in rows[:len(rows) - extensions])}: a copy curriculum, "
        "then retrieval tasks), then the recipe "
        f"`{recipe.name}` extends it in {extensions} stages that raise theta and the context "
        "together, with zigzag ring attention over "
        f"{rows[-1]['ranks']} processes. Needle: teacher-forced exact match of the "
        "5-digit answer (chance 1e-5), on numbers the training never saw.", "",
        "## Targets", ""]
    b2, a2 = nb.get(target_len, float("nan")), na.get(target_len, float("nan"))
    p_b = pb.get(target_len, {}).get("ppl", float("nan"))
    p_a = pa.get(target_len, {}).get("ppl", float("nan"))
    checks = [(f"needle at {target_len} (4x) before <= {TARGET_BEFORE:.0%}", _fmt(b2, ".0%"),
               b2 <= TARGET_BEFORE),
              (f"needle at {target_len} after >= {TARGET_AFTER:.0%}", _fmt(a2, ".0%"),
               a2 >= TARGET_AFTER),
              (f"perplexity at {target_len}: after < before", f"{_fmt(p_a)} < {_fmt(p_b)}",
               p_a < p_b)]
    lines += ["| target | measured | met |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'yes' if ok else '**no**'} |" for name, value, ok in checks]
    trained = max((v for n, v in nb.items() if n <= first), default=float("nan"))
    if not summary["quick"] and not trained >= TARGET_AFTER:
        t_first = tb.get(first, float("nan"))
        lines += ["", f"Exact retrieval at the trained lengths peaks at {_fmt(trained, '.0%')} "
                  f"(answer digits right at {first} tokens: {_fmt(t_first, '.0%')}; chance 10%): "
                  "within this run's step budget the model's copying is not reliable enough "
                  "for five digits in a row every time, which also caps the score after the "
                  "extension. The extension shows in the digit accuracy and the perplexity: at "
                  f"{target_len} tokens the digits are right "
                  f"{_fmt(tb.get(target_len, float('nan')), '.0%')} of the time before it and "
                  f"{_fmt(ta.get(target_len, float('nan')), '.0%')} after (exact: "
                  f"{_fmt(b2, '.0%')} -> {_fmt(a2, '.0%')})."]
    lines += ["", "## Needle accuracy by context length", "",
              "Exact match of the whole answer, and the share of answer digits right "
              "(teacher-forced).", "",
              "| context | exact before | exact after | digits before | digits after |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {n}{' (trained)' if n <= first else ''} | {_fmt(nb[n], '.0%')} | "
              f"{_fmt(na.get(n, float('nan')), '.0%')} | {_fmt(tb[n], '.0%')} | "
              f"{_fmt(ta.get(n, float('nan')), '.0%')} |" for n in nb]
    lines += ["", "![needle before](needle_before.png) ![needle after](needle_after.png)", "",
              "## Perplexity by context length (held-out retrieval documents)", "",
              f"Whole prefix of that length, and its last {int(next(iter(pb.values()))['last_k'])} "
              "tokens (the far positions, where a model whose positions break down fails first).",
              "", "| context | ppl before | ppl after | last-k before | last-k after |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {_fmt(pb[n]['ppl'])} | {_fmt(pa[n]['ppl'])} | {_fmt(pb[n]['last_k_ppl'])} | "
              f"{_fmt(pa[n]['last_k_ppl'])} |" for n in pb]
    lines += ["", "![ppl](ppl.png) ![ppl last k](ppl_last_k.png)", ""]
    lines += _ruler_lines(summary)
    lines += ["",
              "## Training stages", "",
              "| stage | seq | theta | method | ranks | steps | final loss | peak MB/rank | tokens/s | train s |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['stage']} | {r['seq_length']} | {r['rope_theta']:g} | {r['method']} | "
              f"{r['ranks']} | {r['steps']} | {_fmt(r['final_loss'])} | {_fmt(r['peak_memory_mb'], '.0f')} | "
              f"{_fmt(r['tokens_per_s'], '.0f')} | {_fmt(r['train_s'], '.0f')} |" for r in rows]
    lines += ["", "Peak memory: the rank's RSS high-water mark during the step (CPU); tokens/s: "
              "the median step, counting every token of the step once (a sequence split over "
              "the ranks counts once).", "", "![loss](loss.png) ![stages](stages.png)", "",
              "## Time", "",
              "| phase | wall s | CPU s | processes | idle estimate s | load avg (start/end) |",
              "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {name} | {t['wall_s']:.0f} | {t['cpu_s']:.0f} | {t['processes']} | "
              f"{t['cpu_s'] / t['processes']:.0f} | {t['load_start']:.1f} / {t['load_end']:.1f} |"
              for name, t in timings.items()]
    wall = sum(t["wall_s"] for t in timings.values())
    cpu = sum(t["cpu_s"] for t in timings.values())
    idle = sum(t["cpu_s"] / t["processes"] for t in timings.values())
    lines += [f"| **total** | {wall:.0f} | {cpu:.0f} | | {idle:.0f} | |", "",
              f"{summary['cpu_count']} CPUs. CPU s counts this process and the training ranks "
              "(one thread each). On a shared machine (load average above the CPU count) wall "
              "time mostly measures the other jobs; the idle estimate, CPU seconds divided by "
              "the processes that share the work, is what an idle machine with that many cores "
              "would take (roughly: an overloaded machine also costs cache misses).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _params(out: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(out / "base_model" / "model.safetensors"), "pt") as f:
        n = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    return f"{n / 1e6:.2f}M-parameter"


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
