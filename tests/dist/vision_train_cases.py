"""Rank functions for ``easy-context train`` on image conversations (test_train_vision.py)."""

from __future__ import annotations

from pathlib import Path


def vision_train_run(model: str, dataset: str, output: str, **overrides) -> list[dict]:
    """Train ``model`` on ``dataset`` (prepare-data --processor) on this pool's ranks; rank
    0's per-step metrics."""
    import torch.distributed as dist

    from easy_context.train.config import TrainConfig
    from easy_context.train.trainer import results_of, run_training
    from tests.vision_fixtures import qwen_processor

    qwen_processor()  # registers the test's image-only Qwen processor (the export saves it)
    values = dict(model=model, dataset=dataset, seq_length=64, max_train_steps=1,
                  learning_rate=1e-3, output_dir=output, mixed_precision="fp32", seed=7)
    values.update(overrides)
    config = TrainConfig(**values)
    config.validate()
    run_training(config)
    dist.barrier()
    return results_of(Path(output)) if dist.get_rank() == 0 else []


def vision_train_error(model: str, dataset: str, output: str, **overrides) -> str:
    """The message a refused run raises on this rank."""
    try:
        vision_train_run(model, dataset, output, **overrides)
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        return f"{type(e).__name__}: {e}"
    return "no error"
