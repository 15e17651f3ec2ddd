"""Checks of a training run against its files and this machine, before any rank starts.

``TrainConfig.validate`` checks the values themselves; this module checks what only the
launcher knows (how many ranks there will be) and what is on disk (the model folder, the
dataset and its window length, the DeepSpeed config, the optional packages a flag needs).
Each failure is a ValueError or FileNotFoundError that says what to change, raised before
any process is spawned: a mistake costs a second, not a minute of loading on every rank and
a report from each of them. The ranks check again as they go (torchrun skips this module).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from ..utils.paths import check_output_path
from .config import TrainConfig


def launch_world_size(config: TrainConfig) -> int:
    """How many ranks the run will have: torchrun's WORLD_SIZE, else --nproc-per-node."""
    return int(os.environ.get("WORLD_SIZE", config.nproc_per_node))


def check_layout(config: TrainConfig, world: int, heads: int | None = None,
                 kv_heads: int | None = None) -> None:
    """The dp x sp grid, the method (with the model's heads when known) and the sequence
    length fit ``world`` ranks: the checks the trainer makes on every rank, made once here."""
    from ..mesh import check_mesh
    from ..parallel import get_method

    method = get_method(config.parallel_mode)
    sp = config.sp_size_for(world)
    if sp > world:
        raise ValueError(f"--sp-size {sp} is more than the {world} ranks of this run: raise "
                         f"--nproc-per-node to a multiple of {sp}, or lower --sp-size")
    check_mesh(world, sp, config.ring_degree)
    method.check(heads, kv_heads, sp, config.ring_degree)
    multiple = method.required_multiple(sp, config.ring_degree)
    if config.seq_length % multiple:
        raise ValueError(f"--seq-length {config.seq_length} is not divisible by {multiple} "
                         f"({method.name} over {sp} ranks); use a multiple of {multiple}, e.g. "
                         f"{-(-config.seq_length // multiple) * multiple}")


def _looks_local(value: str) -> bool:
    """A path rather than a Hub name ("org/name", or a bare legacy name)."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or Path(value).exists()


def check_model(config: TrainConfig) -> None:
    from ..models import check_model_path

    check_model_path(config.model, weights=True)


def check_dataset(config: TrainConfig, world: int, check_model: bool = False) -> None:
    """A local dataset exists, has input_ids, a step's worth of rows and long enough rows;
    with ``check_model``, that the model takes its images (or refuses what the vision path
    does not take). (A Hub name is left to the ranks: checking it would download it.)"""
    from .data import check_windows, load_training_dataset

    path = Path(config.dataset).expanduser()
    if not _looks_local(config.dataset):
        return
    if not path.exists():
        raise FileNotFoundError(f"--dataset {config.dataset} does not exist; make one with "
                                "`easy-context prepare-data`")
    ds = load_training_dataset(str(path))
    check_windows(ds, config.seq_length, config.batch_size, world // config.sp_size_for(world))
    if check_model and _looks_local(config.model):  # a hub name's config is the ranks' to read
        from ..models import load_config
        from .vision import check_vision_run, has_images, is_vision_config

        check_vision_run(config, has_images(ds), is_vision_config(
            load_config(config.model, trust_remote_code=config.trust_remote_code)))


def check_files(config: TrainConfig) -> None:
    check_output_path("--output-dir", config.output_dir, folder=True)
    if config.deepspeed_config:
        path = Path(config.deepspeed_config)
        if not path.is_file():
            raise FileNotFoundError(f"--deepspeed-config {path}: no such file")
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed-config {path} is not valid JSON: {e}") from e
        if config.engine != "deepspeed":
            raise ValueError("--deepspeed-config needs --engine deepspeed")


def check_packages(config: TrainConfig) -> None:
    """The optional packages the flags ask for are installed."""
    needed = {"deepspeed": ("--engine deepspeed", config.engine == "deepspeed"),
              "wandb": ("--wandb", bool(config.wandb)),
              "tensorboard": ("--tensorboard", config.tensorboard)}
    for package, (flag, wanted) in needed.items():
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} needs the {package} package: pip install {package}")
    if config.lora_rank:
        from .lora import require_peft

        from .qlora import require_bitsandbytes

        try:
            require_peft()
            if config.lora_4bit:
                require_bitsandbytes()
        except ImportError as e:  # a usage error, as for the packages above
            raise ValueError(str(e)) from None


def preflight(config: TrainConfig, model: bool = True) -> None:
    """Every check above, for a validated config. ``model=False`` skips the model folder, for
    a recipe stage whose model an earlier stage is still to write."""
    from ..models import model_heads

    world = launch_world_size(config)
    check_files(config)
    check_packages(config)
    if model:
        check_model(config)
        check_layout(config, world, *model_heads(config.model))
    else:
        check_layout(config, world)
    check_dataset(config, world, check_model=model)
