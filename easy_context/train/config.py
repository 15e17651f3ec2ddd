"""The training configuration: one dataclass, whose fields are the CLI flags and YAML keys.

``--config run.yaml`` reads a YAML file whose keys equal the flags (``seq_length`` or
``seq-length``); flags given on the command line win over the file. A run writes its
resolved configuration to ``<output_dir>/train_config.yaml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import one_line
from ..parallel import SEQUENCE_PARALLEL, get_method


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # --- the original train.py's flags
    model: str = _f(None, "model folder (or name) to start from; safetensors weights")
    dataset: str = _f(None, "dataset: a save_to_disk folder, or a load_dataset path or name, "
                            "with an input_ids column of seq_length+1 tokens")
    seq_length: int = _f(4096, "tokens per training sequence (inputs; targets are shifted by one)")
    parallel_mode: str = _f("zigzag_ring_attn", "sequence-parallel method: "
                            + ", ".join(SEQUENCE_PARALLEL) + "; or data_parallel (the local "
                            "method: whole sequences on each rank)")
    ring_degree: int = _f(None, "usp_attn: ranks in each ring (the rest are Ulysses)")
    rope_theta: float = _f(None, "set the RoPE base frequency before training")
    batch_size: int = _f(1, "sequences per data-parallel rank per micro-step")
    gradient_accumulate_every: int = _f(1, "micro-steps per optimizer step")
    max_train_steps: int = _f(100, "optimizer steps")
    learning_rate: float = _f(2e-5, "peak learning rate (AdamW)")
    output_dir: str = _f("output", "where checkpoints, logs and the exported model go")
    seed: int = _f(42, "random seed (data order and initialisation)")
    wandb: str = _f(None, "Weights & Biases project to log to (needs the wandb extra)")
    # --- added
    sp_size: int = _f(None, "ranks per sequence-parallel group; world = dp x sp "
                            "(default: the whole world, or 1 for data_parallel)")
    warmup_steps: int = _f(0, "linear learning-rate warm-up steps")
    lr_schedule: str = _f("constant", "after warm-up", choices=("constant", "linear", "cosine"))
    grad_clip: float = _f(1.0, "clip the global gradient norm (0: off)")
    checkpointing: str = _f("full", "activation checkpointing per decoder layer",
                            choices=("none", "full", "offload", "attention"))
    engine: str = _f("fsdp", "parameter sharding engine", choices=("fsdp", "deepspeed"))
    offload: str = _f("none", "move to CPU memory", choices=("none", "optimizer", "params"))
    mixed_precision: str = _f("bf16", "compute dtype (master weights stay fp32)",
                              choices=("bf16", "fp32"))
    save_every: int = _f(0, "write a checkpoint every N steps (0: only at the end)")
    resume: bool = _f(False, "continue from the latest checkpoint in output_dir")
    log_every: int = _f(1, "log one line every N steps")
    tensorboard: bool = _f(False, "also log to TensorBoard (output_dir/tensorboard)")
    config: str = _f(None, "YAML file whose keys are these flags")
    nproc_per_node: int = _f(1, "processes to start on this machine (torchrun does this itself)")
    rope_scaling: str = _f(None, "RoPE scaling as JSON, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4}'"
                                 " or TYPE:FACTOR (linear:4, yarn:4)")
    deepspeed_config: str = _f(None, "DeepSpeed JSON config (default: the bundled zero3 config)")
    chunked_loss: bool = _f(True, "compute the loss chunk by chunk, never building full logits")
    pg_timeout_minutes: float = _f(10.0, "a collective that waits longer fails with a message")
    trust_remote_code: bool = _f(False, "allow code from the model folder to run")
    deterministic: bool = _f(False, "deterministic kernels (slower backward): on GPUs, the same "
                                    "step gives the same bits, so a resumed run equals an "
                                    "uninterrupted one")
    export: bool = _f(True, "write a Hugging Face model folder (safetensors) at the end")
    # --- max-length mode (easy_context.memory.maxlen) and the planner's choice (train/memory_mode.py)
    mlp_tile: str = _f("auto", "tokens per sequence tile of the MLP and norms (max-length mode): "
                               "a number, off (untiled), or auto (the planner's: untiled when "
                               "that fits the device)")
    head_chunk: str = _f("auto", "query heads per attention chunk (max-length mode): a multiple "
                                 "or a divisor of the query heads per KV head, off (all heads "
                                 "at once), or auto (the planner's)")
    keep_every: int = _f(1, "max-length mode's nested recompute: keep one layer input in K, "
                            "regenerate the others in backward (1: keep all)")
    auto_memory: bool = _f(False, "let the planner (easy-context plan --auto) choose "
                                  "--parallel-mode, --engine, --offload, --checkpointing, "
                                  "--mlp-tile, --head-chunk and --keep-every for this length")
    auto_memory_budget: float = _f(None, "--auto-memory: GiB per device the planner may fill "
                                         "(default: 95%% of a GPU's memory; on a CPU 90%% of "
                                         "the available memory over the local ranks), e.g. "
                                         "to leave room for another process")
    # --- LoRA (easy_context/train/lora.py; the lora extra: peft)
    lora_rank: int = _f(None, "train rank-R LoRA adapters on the frozen model (peft); checkpoints "
                              "and the export hold the adapters only")
    lora_alpha: float = _f(None, "LoRA scale: the adapters add alpha/rank x B A x (default: 2 x rank)")
    lora_targets: str = _f("all-linear", "LoRA: the decoder layers' linear modules to adapt, by "
                                         "name (q_proj,v_proj), or all-linear")
    merge: bool = _f(False, "LoRA: also export the model with the adapters merged in (final_model/)")
    lora_4bit: bool = _f(False, "QLoRA: hold the decoder layers' linear weights in 4-bit NF4 on "
                                "every rank (bitsandbytes; --engine fsdp)")

    def sp_size_for(self, world: int) -> int:
        """Ranks per sequence-parallel group in a world of ``world`` ranks."""
        if get_method(self.parallel_mode).layout == "whole":
            return 1
        return self.sp_size or world

    def validate(self) -> None:
        """Check every value on its own and against the others (not against files or the
        machine: see easy_context/train/preflight.py); raise a ValueError saying what to change."""
        from ..models import parse_rope_scaling

        for name, f in _fields().items():  # YAML files and recipes bypass argparse's types
            setattr(self, name, _coerce(name, _type_of(f), getattr(self, name)))
        if not self.model:
            raise ValueError("--model is required (a local model folder or a hub name)")
        if not self.dataset:
            raise ValueError("--dataset is required (a save_to_disk folder, or a dataset name)")
        method = get_method(self.parallel_mode)  # the user's spelling (an alias) is kept
        positive = ("seq_length", "batch_size", "gradient_accumulate_every", "max_train_steps",
                    "log_every", "nproc_per_node", "sp_size", "ring_degree", "lora_rank")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
        for name in ("warmup_steps", "save_every", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0 (0: off), got {getattr(self, name)}")
        # "not x > 0" also rejects NaN
        for name in ("learning_rate", "pg_timeout_minutes", "rope_theta", "auto_memory_budget"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_flag(name)} must be > 0, got {value}")
        if self.seq_length < 2:
            raise ValueError("--seq-length must be >= 2")
        if self.auto_memory_budget is not None and not self.auto_memory:
            raise ValueError("--auto-memory-budget is the planner's budget: add --auto-memory")
        for name, f in _fields().items():
            choices = f.metadata.get("choices")
            if choices and getattr(self, name) not in choices:
                raise ValueError(f"{_flag(name)} must be one of {choices}, "
                                 f"got {getattr(self, name)!r}")
        if method.layout == "whole" and self.sp_size not in (None, 1):
            raise ValueError(f"{self.parallel_mode} has no sequence parallelism: drop --sp-size "
                             "or set it to 1")
        if method.needs_ring_degree and self.ring_degree is None:
            raise ValueError(f"{method.name} needs --ring-degree (ranks per ring; sp_size / "
                             "ring_degree ranks do Ulysses)")
        if self.ring_degree is not None and not method.needs_ring_degree:
            raise ValueError(f"--ring-degree applies to usp_attn only, not {method.name}; drop it")
        for name in ("mlp_tile", "head_chunk"):
            parse_tiling(getattr(self, name), name)
        if self.keep_every < 1:
            raise ValueError(f"--keep-every must be >= 1, got {self.keep_every}")
        parse_rope_scaling(self.rope_scaling)
        self._validate_lora()

    def _validate_lora(self) -> None:
        if self.lora_rank is None:
            given = [flag for flag, on in (("--lora-alpha", self.lora_alpha is not None),
                                           ("--lora-targets", self.lora_targets != "all-linear"),
                                           ("--merge", self.merge),
                                           ("--lora-4bit", self.lora_4bit)) if on]
            if given:
                raise ValueError(f"{', '.join(given)} apply to LoRA: add --lora-rank R")
        elif self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        elif self.auto_memory:
            # max-length mode runs the adapters (a layer whose projections carry them takes
            # the generic path, which calls the model's own modules), but --auto-memory's
            # resolution is not tested with LoRA: the flags plan --auto prints are
            raise ValueError("--auto-memory does not plan LoRA runs; drop it and give the "
                             "flags `easy-context plan --auto --lora-rank R` prints "
                             "(--mlp-tile/--head-chunk for max-length mode), or drop --lora-rank")
        if self.lora_4bit and self.engine != "fsdp":
            raise ValueError("--lora-4bit needs --engine fsdp: ZeRO-3 would partition the 4-bit "
                             "weights, whose layout does not survive it")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _coerce(name: str, hint, value):
    """``value`` as the field's type: YAML reads ``2e-5`` as a string and ``1000.0`` as a float."""
    kind = typing.get_args(hint)[0] if typing.get_args(hint) else hint  # int | None -> int
    if value is None or kind is str and isinstance(value, str):
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{_flag(name)} must be true or false, got {value!r}")
    if kind is str:
        if isinstance(value, os.PathLike) or isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if name == "rope_scaling" and isinstance(value, dict):  # a YAML mapping is fine
            return value
        raise ValueError(f"{_flag(name)} must be a string, got {value!r}")
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
        if kind is int:
            if number != int(number):
                raise TypeError
            return int(number)
        return number
    except (TypeError, ValueError, OverflowError):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{_flag(name)} must be {what}, got {value!r}") from None


def parse_tiling(value, name: str = "mlp_tile") -> int | str | None:
    """--mlp-tile / --head-chunk: "auto", None for "off", or a positive number."""
    if isinstance(value, str) and value.lower() in ("auto", "off"):
        return value.lower() if value.lower() == "auto" else None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be auto, off or a number >= 1, "
                         f"got {value!r}")
    return number


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _type_of(f: dataclasses.Field):
    return typing.get_type_hints(TrainConfig)[f.name]


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field, with the field's help; defaults are None so a YAML file can fill them."""
    for name, f in _fields().items():
        flag = "--" + name.replace("_", "-")
        hint = _type_of(f)
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{f.metadata['help']} (default: {f.default})")
        else:
            parser.add_argument(flag, type=hint, default=None, choices=f.metadata.get("choices"),
                                help=f"{f.metadata['help']} (default: {f.default})")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the YAML file (``--config``), then the flags given."""
    values: dict = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path} is not valid YAML: {one_line(str(e))}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: expected a mapping of flag: value")
        fields = _fields()
        for key, value in loaded.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ValueError(f"--config {path}: unknown key {key!r}; keys are the flags, "
                                 f"e.g. {sorted(fields)[:6]}...")
            values[name] = value
    for name in _fields():
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    config = TrainConfig(**values)
    config.validate()
    return config


def save_config(config: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
