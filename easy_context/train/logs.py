"""One log line per step on rank 0, metrics.jsonl, a progress bar, TensorBoard/W&B optional."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("easy_context.train")


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
        self.bar = tqdm(total=config.max_train_steps, initial=resume_step, desc="train",
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
            log.info("step %d | loss %.4f | ppl %.2f | lr %.2e | grad norm %.3f | %.0f tok/s | "
                     "peak mem %.0f MB", step, metrics["loss"], metrics["ppl"], metrics["lr"],
                     metrics["grad_norm"], metrics["tokens_per_s"], metrics["peak_memory_mb"])
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step":
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
