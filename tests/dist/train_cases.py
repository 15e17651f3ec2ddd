"""Rank functions for trainer tests: build a TrainConfig, run the trainer, return metrics."""

from __future__ import annotations

from pathlib import Path

from easy_context.train.config import TrainConfig
from easy_context.train.trainer import results_of, run_training


def train_run(workdir: str, name: str, **overrides) -> list[dict]:
    """Train the tiny model in ``workdir`` on its dataset; returns rank 0's per-step metrics."""
    import torch.distributed as dist

    work = Path(workdir)
    values = dict(model=str(work / "model"), dataset=str(work / "data"), seq_length=32,
                  max_train_steps=3, learning_rate=1e-3, output_dir=str(work / name),
                  mixed_precision="fp32", checkpointing="full", seed=7)
    values.update(overrides)
    config = TrainConfig(**values)
    config.validate()
    run_training(config)
    dist.barrier()
    return results_of(config.output_dir) if dist.get_rank() == 0 else []


def train_error(workdir: str, **overrides) -> str:
    """The message of the error a bad configuration raises (on this rank)."""
    try:
        train_run(workdir, "bad", **overrides)
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def strict_train_run(workdir: str, name: str, **overrides) -> dict:
    """``train_run`` with every collective checked (easy_context/utils/strict_collectives.py):
    rank 0's metrics and the collectives each op name ran, summed over this rank."""
    from easy_context.utils.strict_collectives import StrictCollectives

    with StrictCollectives() as seen:
        metrics = train_run(workdir, name, **overrides)
    return {"metrics": metrics, "counts": dict(seen.counts)}
