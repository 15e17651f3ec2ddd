"""Progressive context-extension recipes: a YAML list of training stages, run in order.

    name: llama2-7b-1m
    nproc_per_node: 8
    defaults:                 # TrainConfig keys shared by every stage
      batch_size: 1
      learning_rate: 2.0e-5
    stages:
      - name: 32k_rope_1m
        model: meta-llama/Llama-2-7b-hf
        seq_length: 32768
        rope_theta: 1000000
        max_train_steps: 1000
        dataset: data/slimpajama_32k
        output_dir: output/7B_32K_rope_1M
      - name: 64k_rope_5m     # model omitted: the previous stage's exported model
        seq_length: 65536
        rope_theta: 5000000
        ...
      - name: rope_1b
        set_rope_theta: 1.0e9 # no training: copy the previous model, edit its config

Each training stage is an ``easy-context train`` run in its own output folder, started with
``--resume``: rerunning a recipe skips finished stages (their folder holds ``stage_done.json``)
and continues an interrupted one from its last checkpoint. Relative paths are relative to
``output_root`` when one is given; otherwise model and dataset paths are relative to the
recipe file's folder and output folders to the current folder.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import one_line
from ..train.config import TrainConfig

_TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}
_STAGE_KEYS = {"name", "set_rope_theta", "set_rope_scaling", "notes"}
_PATH_KEYS = ("model", "dataset", "output_dir")


@dataclass
class Stage:
    name: str
    output_dir: Path
    train: dict = field(default_factory=dict)  # TrainConfig values (None: a config-only stage)
    set_rope_theta: float | None = None
    set_rope_scaling: dict | str | None = None
    notes: str | None = None

    @property
    def trains(self) -> bool:
        return self.set_rope_theta is None and self.set_rope_scaling is None

    @property
    def model_dir(self) -> Path:
        """Where this stage's model ends up."""
        return self.output_dir / "final_model" if self.trains else self.output_dir

    def done(self) -> bool:
        return (self.output_dir / "stage_done.json").exists()


@dataclass
class Recipe:
    name: str
    path: Path
    nproc_per_node: int
    stages: list[Stage]


def _resolve(value, base: Path) -> str:
    p = Path(str(value)).expanduser()
    if p.is_absolute():
        return str(p)
    # "org/name" with no such local folder is a hub name; anything else is a local path
    # (it may not exist yet: an earlier step of a demo or script makes it).
    if str(value).count("/") == 1 and not (base / p).exists() and not str(value).startswith("."):
        return str(value)
    return str(base / p)


def load_recipe(path: str | Path, output_root: str | Path | None = None) -> Recipe:
    """Parse and validate a recipe file; every problem is reported before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {one_line(str(e))}") from e
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise ValueError(f"recipe {path}: expected a mapping with a non-empty 'stages' list")
    out_base = Path(output_root) if output_root else Path.cwd()
    base = out_base if output_root else path.parent
    nproc = data.get("nproc_per_node", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"recipe {path}: nproc_per_node must be an integer >= 1, got {nproc!r}")
    defaults = dict(data.get("defaults") or {})
    unknown = set(defaults) - _TRAIN_KEYS
    if unknown:
        raise ValueError(f"recipe {path}: unknown keys in defaults {sorted(unknown)}; "
                         "use `easy-context train` flag names")
    stages: list[Stage] = []
    for i, raw in enumerate(data["stages"]):
        if not isinstance(raw, dict) or "name" not in raw:
            raise ValueError(f"recipe {path}: stage {i + 1} needs a name")
        unknown = set(raw) - _TRAIN_KEYS - _STAGE_KEYS
        if unknown:
            raise ValueError(f"recipe {path}: stage {raw['name']!r} has unknown keys "
                             f"{sorted(unknown)}; use `easy-context train` flag names")
        output_dir = raw.get("output_dir") or f"output/{raw['name']}"
        output_dir = Path(output_dir) if Path(output_dir).is_absolute() else out_base / output_dir
        stage = Stage(name=raw["name"], output_dir=output_dir,
                      set_rope_theta=raw.get("set_rope_theta"),
                      set_rope_scaling=raw.get("set_rope_scaling"), notes=raw.get("notes"))
        if stage.trains:
            values = {**defaults, **{k: v for k, v in raw.items() if k in _TRAIN_KEYS}}
            for key in ("model", "dataset"):
                if key in values and values[key] not in (None, "previous"):
                    values[key] = _resolve(values[key], base)
            if values.get("model") in (None, "previous"):
                if not stages:
                    raise ValueError(f"recipe {path}: the first stage needs a model")
                values["model"] = str(stages[-1].model_dir)
            values["output_dir"] = str(output_dir)
            values["resume"] = True
            config = TrainConfig(**{k: v for k, v in values.items() if k in _TRAIN_KEYS})
            if "nproc_per_node" in data:  # the recipe's count wins over a stage's
                config.nproc_per_node = nproc
            try:
                config.validate()
            except ValueError as e:  # say where: a recipe has many stages
                raise ValueError(f"recipe {path}: stage {stage.name!r}: {e}") from e
            stage.train = dataclasses.asdict(config)
        elif not stages:
            raise ValueError(f"recipe {path}: stage {stage.name!r} edits a model, but no stage "
                             "before it trains one")
        else:
            _check_config_stage(path, stage)
        stages.append(stage)
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"recipe {path}: stage names must be unique, got {names}")
    return Recipe(name=data.get("name", path.stem), path=path, nproc_per_node=nproc,
                  stages=stages)


def _check_config_stage(path: Path, stage: Stage) -> None:
    from ..models import parse_rope_scaling

    theta = stage.set_rope_theta
    if theta is not None:
        try:  # YAML reads 1.0e9 (no sign in the exponent) as a string
            stage.set_rope_theta = float(theta) if not isinstance(theta, bool) else None
        except ValueError:
            stage.set_rope_theta = None
        if stage.set_rope_theta is None or not stage.set_rope_theta > 0:
            raise ValueError(f"recipe {path}: stage {stage.name!r}: set_rope_theta must be a "
                             f"number > 0, got {theta!r}")
    try:
        parse_rope_scaling(stage.set_rope_scaling)
    except ValueError as e:
        raise ValueError(f"recipe {path}: stage {stage.name!r}: set_rope_scaling: {e}") from e


def mark_done(stage: Stage, summary: dict) -> None:
    from ..train.checkpoint import write_text_atomic

    write_text_atomic(stage.output_dir / "stage_done.json", json.dumps(summary, indent=1))
