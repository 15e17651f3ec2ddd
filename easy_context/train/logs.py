"""One log line per step on rank 0, metrics.jsonl, a progress bar, TensorBoard/W&B optional."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from ..utils.progress import progress_bar

log = logging.getLogger("easy_context.train")


def step_line(metrics: dict) -> str:
    """The log line of one step. Peak memory is this rank's (its process's peak resident
    memory on the CPU, peak allocated tensors on CUDA); left out where it is unknown."""
    line = (f"step {metrics['step']} | loss {metrics['loss']:.4f} | ppl {metrics['ppl']:.2f} | "
            f"lr {metrics['lr']:.2e} | grad norm {metrics['grad_norm']:.3f} | "
            f"{metrics['tokens_per_s']:.0f} tok/s")
    if metrics.get("peak_memory_mb") is not None:
        line += f" | peak mem {metrics['peak_memory_mb']:.0f} MB"
    return line


class MetricsLogger:
    def __init__(self, output_dir: Path, config, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.every = config.log_every
        if not enabled:
            return
        self.path = Path(output_dir) / "metrics.jsonl"
        # A resumed run rewrites the steps after its checkpoint: keep only those before it.
        kept = []
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.bar = progress_bar(total=config.max_train_steps, initial=resume_step, desc="train",
                        dynamic_ncols=True, mininterval=1.0)
        self.tb = self.wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if config.wandb:
            import wandb

            self.wandb = wandb.init(project=config.wandb, config=dataclasses.asdict(config))

    def log(self, metrics: dict, force: bool = False) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.bar.update(1)
        step = metrics["step"]
        if force or step % self.every == 0:
            log.info("%s", step_line(metrics))
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step" and value is not None:
                    self.tb.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
