"""Pretrained weights for a sharded model, without any rank holding the whole model.

The model is built with its parameters on the meta device (no memory; DeepSpeed builds it
under ``zero.Init`` instead) and its buffers real: rotary tables are computed when the model
is built, not read from checkpoints. The engine shards it, then fills its shards from the
model folder's safetensors files, read a slice at a time:

- FSDP2 (engines/fsdp.py): every rank reads the rows of each tensor that its shard holds,
  so host and device memory stay at about 1/world of the model on every rank, and the
  folder is read once in all;
- DeepSpeed ZeRO-3 (engines/deepspeed.py): rank 0 reads one tensor at a time and DeepSpeed
  scatters it to the partitions.

Before this, every rank loaded the whole fp32 model and moved it to its GPU before
sharding: host RAM was ranks x model (a 13B model: 52 GB per process).

Names: a folder written by ``save_pretrained`` holds the model's own parameter names (a tied
weight once). A checkpoint whose names transformers has to convert (renamed or fused
tensors: Mixtral's experts, say) and a hub name (no local folder) take the general way:
rank 0 loads the model with ``from_pretrained``, which knows every conversion, and the
engine broadcasts it; that costs one whole model in rank 0's host memory, once.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@contextlib.contextmanager
def params_on_meta():
    """Build modules with their parameters on the meta device and their buffers real.

    Each parameter is moved to meta as it is registered, before the module's own
    initialisation writes to it, so no parameter memory is ever touched (``torch.empty``
    pages that nothing writes are never resident).
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            extra = dict(kept.__dict__)  # attributes some families tag parameters with
            module._parameters[name] = type(kept)(kept.to("meta"), requires_grad=kept.requires_grad)
            module._parameters[name].__dict__.update(extra)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


class SafetensorsFolder:
    """The tensors of a model folder's safetensors files, read one tensor (or rows of one) at
    a time. Each read maps the file for that tensor only: what it returns is backed by the
    map, which goes (and the pages read with it leave this process's resident memory) when
    the tensor is freed -- the engines copy it into their shards and drop it. A map kept
    open for the whole load would hold every page read so far."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE).is_file():
            with safe_open(self.folder / SINGLE, framework="pt") as f:
                self.files = {name: self.folder / SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.folder} has no {SINGLE} or {INDEX}: training loads "
                                    "safetensors weights only; convert the model with "
                                    "from_pretrained(...).save_pretrained(folder)")
        self._shapes: dict[str, list[int]] = {}

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> list[int]:
        if not self._shapes:  # every header once
            for path in set(self.files.values()):
                with safe_open(path, framework="pt") as f:
                    self._shapes.update({n: list(f.get_slice(n).get_shape()) for n in f.keys()})
        return self._shapes[name]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (in its stored dtype), or only its rows [start, stop) of dim 0:
        only those bytes of the file are read."""
        with safe_open(self.files[name], framework="pt") as f:
            if rows is None:
                return f.get_tensor(name)
            return f.get_slice(name)[rows[0]:rows[1]]


def _value_conversions(model: nn.Module) -> bool:
    """Whether transformers converts this model's tensors on load (not only renames them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers without the conversion machinery converts nothing
        return False
    return any(isinstance(c, WeightConverter) for c in get_model_conversion_mapping(model))


def checkpoint_names(model: nn.Module, folder: SafetensorsFolder) -> dict[str, str] | None:
    """For every parameter and persistent buffer of ``model`` (by its name in
    ``named_parameters()``, tied weights once), the checkpoint tensor that holds it; None
    when the checkpoint does not hold them under the model's own names (then only
    transformers' loading knows how to map it). The same answer on every rank: it reads
    only file headers."""
    if _value_conversions(model):
        return None
    available = folder.keys()
    aliases: dict[int, list[str]] = {}  # a tied weight answers to each of its names
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    names: dict[str, str] = {}
    for name, param in model.named_parameters():
        found = next((n for n in aliases[id(param)] if n in available), None)
        # ZeRO-3 partitions keep the full shape in ds_shape
        if found is None or folder.shape(found) != list(getattr(param, "ds_shape", param.shape)):
            return None
        names[name] = found
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent and name in available:
            if folder.shape(name) != list(buf.shape):
                return None
            names[name] = name
    unused = available - set(names.values())
    if unused:
        log.info("checkpoint tensors the model does not use: %s", sorted(unused)[:8])
    return names


def local_folder(path: str) -> Path | None:
    """The folder itself when ``path`` is a local model folder; None for a hub name."""
    p = Path(path).expanduser()
    return p if p.is_dir() else None


@dataclass
class Pretrained:
    """Where the weights of a model built empty come from: ``path`` (a local folder, read
    shard by shard, or a hub name) and ``load_full``, which returns the whole model from
    ``from_pretrained`` (called on rank 0 only, when the names do not match)."""

    path: str
    load_full: Callable[[], nn.Module]

    def folder(self) -> SafetensorsFolder | None:
        """The folder's safetensors; None for a hub name."""
        folder = local_folder(self.path)
        return None if folder is None else SafetensorsFolder(folder)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks named in the model's ``_no_split_modules`` (its decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} "
                         "(no _no_split_modules): FSDP needs them to shard layer by layer")
    return layers
