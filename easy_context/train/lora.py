"""LoRA: rank-R adapters (the ``peft`` library) trained on a frozen base model.

``easy-context train --lora-rank R`` puts a ``peft`` LoRA layer on each targeted linear module
of the decoder layers (``--lora-targets``: names such as ``q_proj,v_proj``, or ``all-linear``):
``y = W x + (alpha / R) B A x`` with ``W`` frozen and only ``A`` (R x in) and ``B`` (out x R)
trained. The adapters are injected in place (``peft.inject_adapter_in_model``), so the model
keeps its own class and parameter names (``q_proj.weight`` becomes ``q_proj.base_layer.weight``,
beside ``q_proj.lora_A.default.weight``): the sequence-parallel attention, the chunked loss
and both engines see the model they always see, and LoRA changes only what is trained.

The model is still built empty and sharded before any weight is read
(easy_context.train.weights): the adapters are made in the same context as the model (on the
meta device, or partitioned by ZeRO-3's ``zero.Init``), and :class:`LoRAFolder` shows the
engines the base model's safetensors under the injected names, with the adapters' first
values beside them. Those come from a generator seeded by ``--seed`` and the parameter's
name (peft's initialisation: A Kaiming-uniform, B zero, so training starts from the base
model), the same on every rank and in every run whatever the world size.

Adapters are in the decoder layers only: the chunked loss reads the output head's weight
directly. FSDP2 puts each decoder layer's frozen weights and adapters in one unit, which it
allows (unlike FSDP1 without use_orig_params, it asks for one dtype among the trainable
parameters of a unit only, and a unit may have none: torch 2.13's
``FSDPParamGroup._init_mp_dtypes``): it all-gathers every parameter of the unit and
reduce-scatters the gradients of those that have one. The optimizer holds the adapters only.

What gets written (easy_context.train.checkpoint, export_lora below): checkpoints hold the
adapters and their optimizer state only (the frozen base is read again from ``--model`` on
resume, so the run must resume with the same base folder); the export is a peft adapter
folder (``final_adapter/``: adapter_config.json and adapter_model.safetensors, which
``PeftModel.from_pretrained(base, folder)`` loads) and with ``--merge`` the merged model
(``final_model/``: ``W + alpha / R * B A`` as a plain Hugging Face folder).

peft is optional (the ``lora`` extra): it is imported only when ``--lora-rank`` is given.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .weights import Pretrained, SafetensorsFolder

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; peft's saved format drops it from the keys
ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the model's own names
EXTRA_HINT = "pip install 'easy-context[lora]' (or pip install peft)"


def require_peft():
    """The peft module, or an ImportError saying how to install it."""
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"--lora-rank needs the peft package: {EXTRA_HINT}") from e
    return peft


def lora_targets(config: TrainConfig) -> str | list[str]:
    """``--lora-targets`` as peft takes it: "all-linear" or a list of module names."""
    text = (config.lora_targets or "all-linear").strip()
    if text == "all-linear":
        return text
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--lora-targets is empty: give module names (q_proj,v_proj) or all-linear")
    return names


def lora_alpha(config: TrainConfig) -> float:
    return float(config.lora_alpha) if config.lora_alpha is not None else 2.0 * config.lora_rank


def peft_config(config: TrainConfig):
    peft = require_peft()
    # No dropout: it draws different masks on each rank's shard than one process draws on
    # the whole sequence, and the adapters' gradients would no longer equal one process.
    return peft.LoraConfig(r=config.lora_rank, lora_alpha=lora_alpha(config),
                           target_modules=lora_targets(config), lora_dropout=0.0, bias="none",
                           task_type="CAUSAL_LM", base_model_name_or_path=config.model)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that carry an adapter, by name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base checkpoint's name of an injected model's parameter (``.base_layer`` dropped)."""
    return name.replace(".base_layer.", ".")


def inject_lora(model: nn.Module, lora) -> dict[str, nn.Module]:
    """Put ``lora`` (a peft LoraConfig) into ``model`` in place, freeze every other parameter,
    and return the modules that got an adapter."""
    from .weights import decoder_layers

    peft = require_peft()
    with warnings.catch_warnings():
        # zero.Init partitions the adapters as they are made: peft's initialisation of those
        # empty partitions does nothing (their values come from LoRAFolder), and says so.
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        try:
            peft.inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
        except ValueError as e:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, nn.Linear)})
            raise ValueError(f"--lora-targets: {e}; the model's linear modules are "
                             f"{linear}") from None
    modules = lora_modules(model)
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    outside = [name for name, m in modules.items() if id(m) not in inside]
    if outside:
        raise ValueError(f"--lora-targets: adapters only go into the decoder layers, not "
                         f"{outside[:4]} (the chunked loss reads the output head's weight itself)")
    skipped = _skipped_adapters(model, modules)
    if skipped:
        raise ValueError(f"--lora-targets: adapters on {skipped[:4]} would never run: a recurrent "
                         "layer's convolution kernel reads the convolution's weight itself "
                         "(transformers' and easy_context's alike), so the adapter would be "
                         "neither applied nor trained; leave the convolutions out (all-linear "
                         "adapts linear layers only)")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return modules


def _skipped_adapters(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    """The adapted modules inside a recurrent layer that are convolutions: its kernel function
    takes the module and reads ``conv1d.weight`` (causal_conv1d_forward), never calling it."""
    from ..integrations.hf_recurrent import stateful_modules

    inside = {id(m) for layer in stateful_modules(model) for m in layer.modules()}
    return [name for name, m in modules.items()
            if id(m) in inside and isinstance(m.get_base_layer(), nn.Conv1d)]


def add_lora(model: nn.Module, pretrained: Pretrained, config: TrainConfig,
             context: contextlib.AbstractContextManager | None = None,
             device: torch.device = torch.device("cpu")):
    """Inject the adapters into ``model`` (built empty) in ``context`` (the context the model
    was built in: the adapters are made empty too), with --lora-4bit quantize the base onto
    ``device`` (easy_context/train/qlora.py), and return (model, where its weights come from)."""
    lora = peft_config(config)
    with context or contextlib.nullcontext():
        modules = inject_lora(model, lora)
    load_full = _load_full_with_adapters(pretrained, lora, config.seed)
    if config.lora_4bit:
        from .qlora import quantize_base, quantized_weight_names

        quantized = quantize_base(model, pretrained.folder(), device, base_name)
        log.info("QLoRA: %d weights of the decoder layers in 4-bit NF4 on every rank", quantized)
        # the 4-bit weights are no parameters of the model (filled just now): the full model
        # that rank 0 loads when only transformers can map the checkpoint (Qwen3-Next's
        # conversion mapping) must not hold them, or loading its state dict fails on them
        load_full = _without(load_full, quantized_weight_names(model))
    trainable = sum(_numel(p) for n, p in model.named_parameters() if is_adapter(n))
    total = sum(_numel(p) for p in model.parameters())
    log.info("LoRA rank %d, alpha %g on %d modules (%s): %d trainable parameters of %d (%.3f%%)",
             config.lora_rank, lora_alpha(config), len(modules),
             ",".join(sorted({n.rsplit(".", 1)[-1] for n in modules})), trainable, total,
             100 * trainable / total)
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()
              if is_adapter(n)}
    return model, LoRAPretrained(pretrained.path, load_full, base=pretrained,
                                 adapter_shapes=shapes, seed=config.seed)


def _without(load_full, names: set[str]):
    """``load_full`` whose model lacks the parameters ``names``."""

    def load() -> nn.Module:
        model = load_full()
        for name in names:
            owner, _, leaf = name.rpartition(".")
            delattr(model.get_submodule(owner), leaf)
        return model

    return load


def _numel(p: torch.Tensor) -> int:
    return int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3 partitions


def initial_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The first value of adapter ``name``: peft's initialisation (A Kaiming-uniform with
    a = sqrt(5), as nn.Linear; B zero, so the model starts as the base model), drawn from a
    generator seeded by the run's seed and the name: the same on every rank and world size."""
    value = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in name:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
    return value


class LoRAFolder:
    """A model folder's safetensors as the LoRA model names them: each base tensor under its
    injected name, and each adapter's first value. Reads like SafetensorsFolder (the engines
    read their shards' rows through it)."""

    def __init__(self, base: SafetensorsFolder, injected: set[str],
                 adapter_shapes: dict[str, tuple[int, ...]], seed: int):
        # injected: the modules that got an adapter; their weight and bias moved under them
        self.base, self.adapter_shapes, self.seed = base, adapter_shapes, seed
        self.names: dict[str, str] = {}
        for name in base.keys():
            module, _, leaf = name.rpartition(".")
            self.names[f"{module}.base_layer.{leaf}" if module in injected else name] = name

    def keys(self) -> set[str]:
        return set(self.names) | set(self.adapter_shapes)

    def shape(self, name: str) -> list[int]:
        if name in self.adapter_shapes:
            return list(self.adapter_shapes[name])
        return self.base.shape(self.names[name])

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name in self.adapter_shapes:
            value = initial_adapter(name, self.adapter_shapes[name], self.seed)
            return value if rows is None else value[rows[0]:rows[1]]
        return self.base.read(self.names[name], rows)


class LoRAPretrained(Pretrained):
    """Pretrained weights of a LoRA model: the base folder seen through LoRAFolder."""

    def __init__(self, path: str, load_full, base: Pretrained,
                 adapter_shapes: dict[str, tuple[int, ...]], seed: int):
        super().__init__(path, load_full)
        self.base, self.adapter_shapes, self.seed = base, adapter_shapes, seed

    def folder(self) -> LoRAFolder | None:
        folder = self.base.folder()
        if folder is None:
            return None
        injected = {n.rsplit(".lora_", 1)[0] for n in self.adapter_shapes}
        return LoRAFolder(folder, injected, self.adapter_shapes, self.seed)


def _load_full_with_adapters(pretrained: Pretrained, lora, seed: int):
    """``load_full`` for a LoRA model (rank 0, when only transformers can map the checkpoint's
    names): the base from from_pretrained, the adapters injected with their first values."""

    def load_full() -> nn.Module:
        model = pretrained.load_full()
        inject_lora(model, lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if is_adapter(name):
                    param.copy_(initial_adapter(name, tuple(param.shape), seed))
        return model

    return load_full


# --------------------------------------------------------------------------- export
def to_peft_keys(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our adapter names -> the keys of peft's adapter_model.safetensors (PeftModel's prefix,
    no adapter name): model.layers.0.q_proj.lora_A.default.weight ->
    base_model.model.model.layers.0.q_proj.lora_A.weight."""
    return {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): t for n, t in adapters.items()}


def merged_state_dict(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter folded in: W + scaling * B @ A, in
    float64 then cast back (the merged weight differs from base + adapter by one rounding).
    ``state``: the LoRA model's full state dict; ``scaling``: alpha / rank per module."""
    merged = {base_name(n): t for n, t in state.items() if not is_adapter(n)}
    for module, scale in scaling.items():
        a = state[f"{module}.lora_A.{ADAPTER}.weight"].double()  # (R, in)
        b = state[f"{module}.lora_B.{ADAPTER}.weight"].double()  # (out, R)
        w = merged[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.double() + scale * (b @ a)).to(w.dtype)
    return merged


def write_adapter(adapters: dict[str, torch.Tensor], lora_config, tokenizer, out_dir: Path) -> None:
    """Rank 0: peft's adapter folder (adapter_config.json, adapter_model.safetensors), atomically."""
    from safetensors.torch import save_file

    from .checkpoint import _fsync_tree

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora_config.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in to_peft_keys(adapters).items()},
              str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _fsync_tree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def export_lora(engine, model: nn.Module, tokenizer, config: TrainConfig, output: Path) -> None:
    """Collective: ``final_adapter/`` (peft's format), and with --merge ``final_model/``."""
    from .checkpoint import export_hf

    modules = lora_modules(model)
    lora = peft_config(config)
    # What "all-linear" resolved to, so that the folder says which modules it adapts.
    lora.target_modules = sorted({n.rsplit(".", 1)[-1] for n in modules})
    state = engine.full_state_dict(trainable_only=not config.merge)
    if dist.get_rank() == 0:
        adapters = {n: t for n, t in state.items() if is_adapter(n)}
        write_adapter(adapters, lora, tokenizer, output / "final_adapter")
        log.info("exported the adapters to %s", output / "final_adapter")
        if config.merge:
            if config.lora_4bit:  # not parameters: every rank holds them (qlora.py)
                from .qlora import dequantized_weights

                state.update(dequantized_weights(model))
            scaling = {name: float(m.scaling[ADAPTER]) for name, m in modules.items()}
            export_hf(model, merged_state_dict(state, scaling), tokenizer, output / "final_model",
                      config.seq_length)
            log.info("exported the merged model to %s", output / "final_model")
    dist.barrier()
