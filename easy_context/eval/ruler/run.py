"""The resumable RULER runner: every length x task x sample generated sequence-parallel,
scored, appended to ``samples.jsonl``; tables and a plot at the end.

Output folder:

    config.json     the resolved config (what makes a sample: seed, template, haystack,
                    answer budget, the model and its settings) - a rerun with other values
                    is refused, since its samples would not be the ones on file
    samples.jsonl   one line per finished sample, flushed as it is written: a rerun skips
                    those (more tasks, lengths or samples can be added to a folder later)
    scores.csv      task, length, score (x100), samples, metric
    scores.md       task x length table with the averages
    scores.png      score against length, one line per task (drawn from scores.csv)

Every rank builds the same prompts (same seed) and calls ``generate`` with the whole
prompt; only rank 0 reads and writes the folder, and tells the others what is done.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .haystack import TEMPLATES, PromptEncoder
from .scoring import markdown_table, score_rows, score_sample, write_scores_csv
from .tasks import TASKS, RulerSample, check_length, get_task, make_sample

CONFIG_FILE, SAMPLES_FILE = "config.json", "samples.jsonl"
# What decides a sample's prompt and answer; a folder's samples are reused only when these
# match (tasks, lengths and the sample count may grow: samples are keyed by them).
SAMPLE_KEYS = ("seed", "template", "haystack_dir", "max_new_tokens", "settings")


@dataclass
class RulerConfig:
    """What to evaluate (the flags of ``easy-context eval-ruler``)."""

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    num_samples: int = 20
    """Samples per task and length (RULER uses 500)."""
    seed: int = 0
    template: str = "base"
    """base: plain text after BOS; chat: the tokenizer's chat template."""
    haystack_dir: str | None = None
    """Folder of .txt files for the essay haystack; None: generated text."""
    max_new_tokens: int | None = None
    """Every task's answer budget; None: each task's own (RULER's tokens_to_generate)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What else changes the answers: the model folder, dtype, RoPE overrides."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"--tasks is empty; name some of: {', '.join(TASKS)}")
        for task in self.tasks:
            get_task(task)
        if len(set(self.tasks)) < len(self.tasks):
            raise ValueError(f"--tasks names a task twice: {' '.join(self.tasks)}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"--lengths must be positive token counts, got {self.lengths}")
        if len(set(self.lengths)) < len(self.lengths):
            raise ValueError(f"--lengths names a length twice: {self.lengths}")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.template not in TEMPLATES:
            raise ValueError(f"--template must be one of {TEMPLATES}, got {self.template!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.haystack_dir is not None:
            self.haystack_dir = str(Path(self.haystack_dir).resolve())

    def sample(self, task: str, length: int, index: int, encoder: PromptEncoder) -> RulerSample:
        return make_sample(task, length, index, encoder, seed=self.seed,
                           haystack_dir=self.haystack_dir, max_new_tokens=self.max_new_tokens)


def check_resume(output_dir: str | Path, cfg: RulerConfig) -> None:
    """Raise when ``output_dir`` holds samples made with other settings than ``cfg``."""
    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return
    old, new = json.loads(path.read_text()), asdict(cfg)
    changed = [f"{k}: {old.get(k)!r} there, {new[k]!r} now" for k in SAMPLE_KEYS
               if old.get(k) != new[k]]
    if changed:
        raise ValueError(f"{output_dir} holds samples of another run ({'; '.join(changed)}); "
                         "give another --output-dir, or delete that one to start over")


def check_lengths(tokenizer, cfg: RulerConfig) -> None:
    """The errors a run would meet, met before any rank starts: a length too short for a
    task's shortest prompt (each task at each length: cwe's counts change at 4096), and a
    haystack folder too short (sample 0 of the essay tasks at the longest length)."""
    encoder = PromptEncoder(tokenizer, cfg.template)
    for task in cfg.tasks:
        for length in cfg.lengths:
            check_length(task, length, encoder, seed=cfg.seed, haystack_dir=cfg.haystack_dir,
                         max_new_tokens=cfg.max_new_tokens)
        spec = TASKS[task]
        if cfg.haystack_dir is not None and spec.kind == "niah" and spec.haystack == "essay":
            cfg.sample(task, max(cfg.lengths), 0, encoder)


def load_records(path: str | Path) -> list[dict]:
    """The sample records of a samples.jsonl; a last line cut short (a run killed while
    writing it) is dropped from the file, so appending continues on a whole line."""
    path = Path(path)
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    if lines[-1].strip():  # no newline at the end: the last write did not finish
        path.write_bytes(raw[:len(raw) - len(lines[-1])])
        lines = lines[:-1]
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not JSON ({e}); delete that line "
                                 "to redo its sample") from e
    return records


def eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's (chat models list several, e.g.
    end of turn), else the tokenizer's EOS."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


@torch.no_grad()
def answer(model: torch.nn.Module, tokenizer, sample: RulerSample, generate_fn: Callable, *,
           device: torch.device | str = "cpu", **generate_kwargs) -> tuple[str, int]:
    """Greedy answer to one sample: its decoded text (up to the first EOS) and length in
    tokens. Every rank of the group calls this with the same sample."""
    from ...models import pad_token_id

    ids = torch.tensor([sample.input_ids], device=device)  # (1, L)
    stops = eos_ids(model, tokenizer)
    eos = None if not stops else stops[0] if len(stops) == 1 else stops
    out = generate_fn(model, ids, attention_mask=torch.ones_like(ids),
                      max_new_tokens=sample.max_new_tokens, do_sample=False, eos_token_id=eos,
                      pad_token_id=pad_token_id(tokenizer, model.config), **generate_kwargs)
    new = out[0, ids.shape[1]:].tolist()  # (T,): after an EOS, padding
    end = next((i for i, t in enumerate(new) if t in stops), len(new))
    return tokenizer.decode(new[:end], skip_special_tokens=True), end


def _todo(cfg: RulerConfig, done: set[tuple]) -> list[tuple[str, int, int]]:
    # Length by length: a run stopped early has every task at the shorter lengths.
    return [(t, n, i) for n in cfg.lengths for t in cfg.tasks for i in range(cfg.num_samples)
            if (t, n, i) not in done]


def _open_folder(out: Path, cfg: RulerConfig) -> set[tuple]:
    """Rank 0: check and (re)write config.json; the (task, length, index) already done."""
    check_resume(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    return {(r["task"], r["length"], r["index"]) for r in load_records(out / SAMPLES_FILE)}


def run_ruler(model: torch.nn.Module, tokenizer, cfg: RulerConfig, output_dir: str | Path, *,
              method: str | None = None, group: dist.ProcessGroup | None = None,
              ring_degree: int | None = None, device: torch.device | str = "cpu",
              progress: bool = True, generate_fn: Callable | None = None) -> list[dict]:
    """Evaluate every sample not yet in ``output_dir`` and write the tables (see the module
    docstring). ``generate_fn`` is easy_context.generation.generate unless given; ``method``
    None means the one the model was switched to with apply_sequence_parallel. Returns the
    score rows (task, length, score, samples, metric) on rank 0, [] on the others."""
    from ...utils.progress import progress_bar
    from ..plots import plot_ruler

    if generate_fn is None:
        from ...generation import generate as generate_fn
    main = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(output_dir)
    encoder = PromptEncoder(tokenizer, cfg.template)  # raises on every rank alike
    done, problem = set(), None
    if main:
        try:
            done = _open_folder(out, cfg)
        except (ValueError, OSError) as e:
            problem = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the others wait here for rank 0's verdict rather than at the first generate
        box = [None if problem is None else str(problem), sorted(done)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and problem is None:
            problem = ValueError(box[0])
        done = {tuple(k) for k in box[1]}
    if problem is not None:
        raise problem
    todo = _todo(cfg, done)
    total = len(cfg.tasks) * len(cfg.lengths) * cfg.num_samples
    bar = progress_bar(total=total, initial=total - len(todo), desc="ruler", unit="sample",
                       disable=not (progress and main))
    sink = (out / SAMPLES_FILE).open("a") if main else None
    try:  # closed on an error too: what is written stays
        for task, length, index in todo:
            sample = cfg.sample(task, length, index, encoder)
            text, new_tokens = answer(model, tokenizer, sample, generate_fn, device=device,
                                      method=method, group=group, ring_degree=ring_degree)
            record = {"task": task, "length": length, "index": index,
                      "tokens": len(sample.input_ids), "units": sample.units,
                      "max_new_tokens": sample.max_new_tokens, "new_tokens": new_tokens,
                      "references": sample.references, "prediction": text,
                      "score": score_sample(text, sample.references, sample.metric),
                      "metric": sample.metric}
            if sink is not None:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            bar.update(1)
            bar.set_postfix(task=task, length=length)
    finally:
        bar.close()
        if sink is not None:
            sink.close()
    if not main:
        return []
    rows = score_rows(load_records(out / SAMPLES_FILE), cfg.tasks, cfg.lengths, cfg.num_samples)
    write_scores_csv(rows, out / "scores.csv")
    (out / "scores.md").write_text(markdown_table(rows))
    plot_ruler(out / "scores.csv", out / "scores.png", title=cfg.settings.get("model"))
    return rows
