"""What a model's attention module is switched to: the method, its process group and ring
degree. ``integrations/hf.py`` writes it on each attention module
(``apply_sequence_parallel``); the attention calls and max-length mode read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ..mesh import SPGroup

ATTR = "_easy_context_sp"


@dataclass
class SequenceParallelSettings:
    """Stored on each attention module by ``apply_sequence_parallel`` (never serialised)."""

    method: str
    group: SPGroup | dist.ProcessGroup | None = None
    ring_degree: int | None = None


def module_settings(module: nn.Module) -> SequenceParallelSettings | None:
    """The settings stored on ``module``, or None where none were."""
    settings = getattr(module, ATTR, None)
    return settings if isinstance(settings, SequenceParallelSettings) else None


def store_settings(module: nn.Module, settings: SequenceParallelSettings) -> None:
    setattr(module, ATTR, settings)
