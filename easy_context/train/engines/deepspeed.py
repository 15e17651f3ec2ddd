"""DeepSpeed ZeRO-3 engine, with optional optimizer / parameter offload, behind the trainer's
engine interface (the same as :class:`~easy_context.train.engines.fsdp.FSDPEngine`).

Configuration: a DeepSpeed JSON file (``--deepspeed-config``; default: the bundled
``easy_context/train/configs/zero3_offload.json``, like the original EasyContext's
``accelerate_configs/zero3_offload.json``). Its ``"auto"`` values are resolved here:

- ``bf16.enabled``                     <- ``--mixed-precision bf16``
- ``train_micro_batch_size_per_gpu``   <- ``--batch-size``
- ``gradient_accumulation_steps``      <- ``--gradient-accumulate-every``
- ``train_batch_size``                 <- micro batch x accumulation x world size
- ``gradient_clipping``                <- ``--grad-clip`` (0: off)
- ``reduce_bucket_size``               <- hidden^2 (as transformers' DeepSpeed integration does)
- ``stage3_prefetch_bucket_size``      <- 0.9 x hidden^2
- ``stage3_param_persistence_threshold`` <- 10 x hidden

The batch, accumulation, clipping and precision keys always follow the flags (the trainer's
data loader and loss decide them; a file that says otherwise is overridden with a warning).

``--offload`` edits the bundled config: ``none`` drops both offload sections, ``optimizer``
keeps ``offload_optimizer`` only, ``params`` keeps both. A user's ``--deepspeed-config`` is
taken as written for offload (it may name NVMe, buffer sizes...). Pinned host memory needs an
accelerator, so ``pin_memory`` is turned off on a CPU-only machine.

Optimizer: a plain ``torch.optim.AdamW`` client optimizer (betas 0.9/0.95, eps 1e-8, no
weight decay, as FSDPEngine), never DeepSpeed's ``cpu_adam`` op (its JIT build takes minutes
and a compiler). ZeRO-Offload refuses a client optimizer unless the config says
``"zero_force_ds_cpu_optimizer": false``, which the bundled config does (and this engine sets
when a user config leaves it out). The step then runs torch's AdamW on the offloaded fp32
partitions on the CPU.

Gradients: ZeRO-3 AVERAGES gradients over the data-parallel world (it divides the bucket by
the world size before the all-reduce / reduce-scatter), and has no option for a plain sum
(``gradient_predivide_factor`` must stay 1.0 under ZeRO-3 with reduce-scatter). Our loss
gradient on each rank is already that rank's share of the global token mean (dp x sp ranks,
every micro-batch), so the exact gradient is the SUM over ranks: ``backward`` multiplies the
loss by the world size before DeepSpeed divides by it. DeepSpeed's own division of the loss by
``gradient_accumulation_steps`` is turned off too (``scale_wrt_gas=False``): each
micro-batch's loss is already its share of the step's mean.

Accumulation: the trainer calls ``loss`` + ``backward`` once per micro-batch and then
``clip_grad_norm`` and ``step`` once. This engine counts the micro-batches and tells DeepSpeed
which one ends the step (``set_gradient_accumulation_boundary``), so the reduction of the
offloaded gradients and the optimizer update happen exactly once per trainer step.

Clipping and the optimizer step: DeepSpeed clips inside its optimizer step (it computes the
global norm of the partitioned fp32 gradients there), so ``clip_grad_norm`` runs DeepSpeed's
``step`` and returns the norm it measured (before clipping, as torch's ``clip_grad_norm_``
returns); ``step`` then has nothing left to do. The learning rate the scheduler set before
``clip_grad_norm`` is the one used, as with FSDPEngine.

Checkpoints: ``engine.save_checkpoint(folder, tag="state")``: every rank writes its ZeRO
partitions. DeepSpeed reads them back with ``torch.load`` internally (its checkpoints hold
pickled Python objects: the optimizer state dict and DeepSpeed's own bookkeeping), so a
DeepSpeed checkpoint must come from a source you trust; this engine loads nothing else.

Export: ``full_state_dict`` all-gathers the fp32 master weights (``safe_get_full_fp32_param``;
the bf16 module copies are not what training optimises) to rank 0 with the model's own key
names (the ``model.`` prefix of the loss module stripped).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...integrations.hf import CausalLMLoss, output_head
from ...memory.maxlen import loss_modules, max_length_settings
from ..config import TrainConfig
from ..weights import Pretrained, checkpoint_names

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "zero3_offload.json"
CHECKPOINT_TAG = "state"


def _hidden_size(config) -> int:
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    if not hidden:
        raise ValueError(f"cannot resolve the DeepSpeed 'auto' bucket sizes: {type(config).__name__} "
                         "has no hidden_size; give numbers in --deepspeed-config")
    return int(hidden)


def _set_flag_value(section: dict, key: str, value, what: str) -> None:
    old = section.get(key, "auto")
    if old != "auto" and old != value:
        log.warning("DeepSpeed config: %s=%r replaced by %r (%s)", key, old, value, what)
    section[key] = value


def build_deepspeed_config(config: TrainConfig, model_config, world_size: int,
                           on_accelerator: bool) -> dict:
    """The DeepSpeed config dict for this run: the JSON file with every "auto" resolved
    (``model_config``: the model's transformers config, for the bucket sizes)."""
    path = Path(config.deepspeed_config) if config.deepspeed_config else DEFAULT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"--deepspeed-config {path}: no such file")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--deepspeed-config {path}: not valid JSON ({e})") from None
    ds = copy.deepcopy(ds)
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", 3) != 3:
        raise ValueError(f"--deepspeed-config {path}: zero_optimization.stage must be 3 "
                         f"(got {zero.get('stage')}); this engine shards parameters (ZeRO-3)")
    zero["stage"] = 3

    if config.deepspeed_config is None:
        if config.offload == "none":
            zero.pop("offload_optimizer", None)
            zero.pop("offload_param", None)
        elif config.offload == "optimizer":
            zero.pop("offload_param", None)
            zero.setdefault("offload_optimizer", {"device": "cpu"})
        else:
            zero.setdefault("offload_optimizer", {"device": "cpu"})
            zero.setdefault("offload_param", {"device": "cpu"})
    elif config.offload != "none":
        log.info("--offload %s ignored: the offload sections of %s are used as written",
                 config.offload, path)
    for key in ("offload_optimizer", "offload_param"):
        if key in zero and not on_accelerator:
            zero[key]["pin_memory"] = False  # pinned memory needs an accelerator

    hidden = _hidden_size(model_config)
    auto = {"reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
    for key, value in auto.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value

    bf16 = config.mixed_precision == "bf16"
    _set_flag_value(ds.setdefault("bf16", {}), "enabled", bf16, "--mixed-precision")
    if ds.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        raise ValueError("fp16 in --deepspeed-config is not supported: use --mixed-precision bf16")
    ds.pop("fp16", None)
    if bf16 and "communication_data_type" not in ds:
        ds["communication_data_type"] = "fp32"  # reduce gradients in fp32, as FSDPEngine does
    _set_flag_value(ds, "train_micro_batch_size_per_gpu", config.batch_size, "--batch-size")
    _set_flag_value(ds, "gradient_accumulation_steps", config.gradient_accumulate_every,
                    "--gradient-accumulate-every")
    _set_flag_value(ds, "train_batch_size",
                    config.batch_size * config.gradient_accumulate_every * world_size,
                    "--batch-size x --gradient-accumulate-every x world size")
    _set_flag_value(ds, "gradient_clipping", float(config.grad_clip or 0.0), "--grad-clip")
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"--deepspeed-config: drop the {key!r} section; the trainer uses "
                             "torch AdamW and its own learning-rate schedule")
    ds.setdefault("steps_per_print", 10**9)
    return ds


def _start_deepspeed_comm() -> None:
    import deepspeed

    if not dist.is_initialized():
        raise RuntimeError("DeepSpeedEngine needs an initialised torch.distributed process group")
    # DeepSpeed reads these from the environment (torchrun sets them; a process group
    # started by hand, e.g. easy_context.testing.DistPool, may not): one machine assumed.
    for key, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()),
                       ("LOCAL_RANK", dist.get_rank())):
        os.environ.setdefault(key, str(value))
    # Uses the process group the trainer initialised; no new one. On CUDA that group has a
    # backend per device type ("cuda:nccl,cpu:gloo", launch.backend_for): DeepSpeed only
    # records the name, and compares it with "nccl", so it is told the device's backend.
    backend = str(dist.get_backend())
    deepspeed.init_distributed(dist_backend="nccl" if "nccl" in backend else backend,
                               auto_mpi_discovery=False)
    _forget_destroyed_groups()


def _forget_destroyed_groups() -> None:
    """DeepSpeed caches process groups (its clone of the world, the data-parallel group) in
    module globals and forgets them only when its own ``deepspeed.comm`` tears them down. A
    world destroyed and made anew in the same process with torch.distributed (as between
    recipe stages) leaves them pointing at groups torch no longer knows, and the next engine
    fails with "Group ... is not registered": release them as DeepSpeed's own world teardown
    does."""
    from deepspeed.utils import groups

    cached = [getattr(groups, name, None) for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP")]
    if all(g is None or _registered(g) for g in cached):
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    else:  # older DeepSpeed: the cached world clone alone
        groups._WORLD_GROUP = None
        groups._DATA_PARALLEL_GROUP = None


def _registered(group) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # KeyError: torch 2.13 for an unknown group
        return False
    return True


def zero_init(config: TrainConfig, model_config, device: torch.device):
    """The context to build the model in: ZeRO-3's ``zero.Init`` partitions each parameter
    over the ranks as soon as its module is built (on the device, or in host memory with
    parameter offload), so no rank ever holds the whole model."""
    import deepspeed

    _start_deepspeed_comm()
    ds = build_deepspeed_config(config, model_config, dist.get_world_size(),
                                on_accelerator=device.type != "cpu")
    return deepspeed.zero.Init(config_dict_or_path=ds)


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, model: nn.Module, device: torch.device, config: TrainConfig,
                 pretrained: Pretrained | None = None):
        """``model``: built under :func:`zero_init` and then filled from ``pretrained``, or
        an ordinary model whose weights are already there (``pretrained=None``)."""
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        _start_deepspeed_comm()
        self.world = dist.get_world_size()
        self.accum = config.gradient_accumulate_every
        self.model = model
        self.ds_config = build_deepspeed_config(config, model.config, self.world,
                                                on_accelerator=device.type != "cpu")
        # Before deepspeed.initialize: the optimizer's fp32 partitions are copied from the
        # parameters there.
        if pretrained is not None:
            self._load_pretrained(pretrained)
        loss_module = CausalLMLoss(model, chunked=config.chunked_loss)
        # Frozen parameters (LoRA's base) stay out: ZeRO-3 keeps no fp32 copy or state for them.
        trainable = [p for p in loss_module.parameters() if p.requires_grad]
        self.frozen = len(trainable) < len(list(loss_module.parameters()))
        client_optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate,
                                             betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
        self.engine, _, _, _ = deepspeed.initialize(
            model=loss_module, optimizer=client_optimizer, config=self.ds_config,
            dist_init_required=False)
        # The chunked loss uses the head's weight (and bias) outside the head's forward: ZeRO-3
        # must gather them whenever the root (the loss module) runs, forward and backward.
        head = output_head(model)[0]
        external = list(head.parameters(recurse=False)) if head is not None else []
        if max_length_settings(model) is not None:  # max-length mode: the final norm too
            external += [p for m in loss_modules(model) for p in m.parameters()]
        for p in external:
            register_external_parameter(self.engine.module, p)
        # The torch optimizer DeepSpeed steps (on the fp32 partitions): the LR scheduler's.
        self.optimizer = self.engine.optimizer.optimizer
        self._micro = 0
        self._norm: float | None = None
        zero = self.ds_config["zero_optimization"]
        log.info("DeepSpeed ZeRO-3: bf16=%s, offload optimizer=%s, offload params=%s, "
                 "accumulation %d, clip %s", self.ds_config["bf16"]["enabled"],
                 zero.get("offload_optimizer", {}).get("device", "none"),
                 zero.get("offload_param", {}).get("device", "none"), self.accum,
                 self.ds_config["gradient_clipping"])

    def _load_pretrained(self, pretrained: Pretrained) -> None:
        """Rank 0 reads one tensor at a time; every rank gathers that parameter (one at a
        time), rank 0 writes it, and DeepSpeed partitions rank 0's values again."""
        import deepspeed

        rank = dist.get_rank()
        folder = pretrained.folder()
        names = None if folder is None else checkpoint_names(self.model, folder)
        if names is None:
            log.warning("%s: the checkpoint's tensor names are not the model's; rank 0 loads "
                        "the whole model with from_pretrained (one model of host memory on "
                        "rank 0)", pretrained.path)
            full = pretrained.load_full().state_dict() if rank == 0 else {}
            names = {name: name for name in self.model.state_dict()}
            read = full.__getitem__
        else:
            read = folder.read
        persistent = set(self.model.state_dict().keys())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if rank == 0:
                        param.data.copy_(read(names[name]))
            for name, buf in self.model.named_buffers():  # not partitioned: broadcast
                if name in persistent and name in names:
                    if rank == 0:
                        buf.copy_(read(names[name]))
                    dist.broadcast(buf, src=0)

    # ---- one optimizer step = accum x (loss, backward), clip_grad_norm, step
    def loss(self, **batch) -> torch.Tensor:
        # Set before each forward/backward: only the step's last micro-batch is a boundary.
        self.engine.set_gradient_accumulation_boundary(self._micro == self.accum - 1)
        return self.engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        # x world: DeepSpeed averages over the ranks, our gradient shares must be summed.
        self.engine.backward(loss * self.world, scale_wrt_gas=False)
        self._micro += 1

    def clip_grad_norm(self, max_norm: float) -> float:
        """Runs DeepSpeed's step (which clips at the config's gradient_clipping, set from
        --grad-clip) and returns the global gradient norm before clipping."""
        if self._micro != self.accum:
            raise RuntimeError(f"DeepSpeedEngine: {self._micro} backward passes before the "
                               f"optimizer step, expected --gradient-accumulate-every={self.accum}")
        configured = self.ds_config["gradient_clipping"]
        if float(max_norm or 0.0) != float(configured or 0.0):
            log.warning("clip at %s requested, DeepSpeed clips at %s (its config)", max_norm,
                        configured)
        self.engine.step()
        self._micro = 0
        norm = self.engine.get_global_grad_norm()
        self._norm = float(norm) if norm is not None else float("nan")
        return self._norm

    def step(self) -> None:
        if self._micro:  # no clip_grad_norm call since the last backward: step now
            self.clip_grad_norm(self.ds_config["gradient_clipping"])
        # DeepSpeed zeroed the gradients in its step.

    # ---- checkpoints: every rank writes its ZeRO partitions
    def save(self, folder: Path) -> list[Path]:
        """Writes this rank's ZeRO partitions; returns the files this rank wrote (DeepSpeed
        does not sync them): those named for its rank, and on rank 0 the shared ones
        (DeepSpeed's recovery scripts)."""
        # Frozen weights are read from the model folder again on resume.
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False,
                                    exclude_frozen_parameters=self.frozen)
        rank = dist.get_rank()  # = DeepSpeed's data-parallel rank: no model parallelism here
        written = sorted(folder.rglob(f"*zero_pp_rank_{rank}_*"))
        if rank == 0:
            written += sorted(p for p in folder.rglob("*")
                              if p.is_file() and "zero_pp_rank_" not in p.name)
        return written

    def load(self, folder: Path) -> None:
        # DeepSpeed unpickles its own checkpoint files with torch.load (see the module docstring).
        path, _ = self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False,
                                              load_module_strict=not self.frozen)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in {folder}")
        self._micro = 0

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights on rank 0's CPU (other ranks get an empty dict);
        ``trainable_only``: only those that require a gradient (LoRA's adapters), and no
        buffers. Collective: every rank must call it."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        rank = dist.get_rank()
        module = self.engine.module
        state: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None:  # frozen: gather the module's copy
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    full = param.detach().float().clone()
            if rank == 0:
                state[name.removeprefix("model.")] = full.detach().to("cpu", torch.float32).clone()
            del full
        if rank == 0 and not trainable_only:
            persistent = set(module.state_dict().keys())
            for name, buf in module.named_buffers():
                if name in persistent:
                    state[name.removeprefix("model.")] = buf.detach().to("cpu").clone()
        return state
