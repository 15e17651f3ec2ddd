"""Sequence parallelism inside transformers' ``Trainer`` and TRL's ``SFTTrainer``.

    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset)     # as before
    enable_sequence_parallel(trainer, method="zigzag_ring_attn", sp_size=2)  # the added line
    trainer.train()

launched as before (``accelerate launch`` with a DDP, FSDP2 or DeepSpeed ZeRO-3 config, or
``torchrun``). The trainer becomes an instance of a subclass of its own class
(:class:`SequenceParallelMixin` first), so its callbacks, logging, saving and what a script
overrides stay as they were, except the methods the mixin replaces (``REPLACED_METHODS``: a
script's own are refused), and Trainer features that would see a shard as the whole
sequence are refused up front. What changes:

- **data**: the loaders are sharded over the data-parallel ranks only, so the ``sp_size``
  ranks of a group draw the same batches; each rank keeps its shard of every batch
  (trainer_batches: targets shifted on the whole sequence, packed documents and padding
  kept apart exactly).
- **loss**: the exact token mean over the sequence-parallel ranks, the data-parallel ranks
  and the accumulation steps, from the same count that the Trainer uses (recounted here: the
  Trainer's own counts each group's batch ``sp_size`` times and divides it as a float),
  without the full logits (easy_context.memory.loss); scaled so that the engine's gradient
  average over all ranks gives the gradient of that mean, and so that the logged loss is
  that mean.
- **eval**: sequence-parallel as well, each group's loss counted once; ``compute_metrics``
  gets logits gathered from the group (``prediction_loss_only`` unset), else none are built.
- **TRL's metrics**: ``entropy`` and ``mean_token_accuracy`` from the chunked loss pass,
  over the whole batch; ``num_tokens`` counts each group's batch once.
- **the Trainer's counts**: tokens seen, flos and the total batch size (samples/s) count each
  group's batch once.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import ParallelMesh, build_mesh, process_group
from ..parallel import get_method
from .hf import apply_sequence_parallel, check_model_supported
from .loss_forward import LossSettings, chunked_loss_possible, install_loss_forward
from .trainer_batches import (ShardedBatch, check_batch_keys, check_vision_batch, count_targets,
                              has_images, has_vision_keys, shard_trainer_batch)
from .vision import VisionShard, is_vision_language, tower_sharded

log = logging.getLogger(__name__)
Tensor = torch.Tensor


class SequenceParallelState:
    """What :func:`enable_sequence_parallel` decided, kept on the trainer."""

    def __init__(self, mesh: ParallelMesh, method: str, ring_degree: int | None,
                 pad_token_id: int, pad_to_multiple: bool, settings: LossSettings,
                 base_model: nn.Module, max_length: bool):
        self.mesh, self.method, self.ring_degree = mesh, method, ring_degree
        self.pad_token_id, self.pad_to_multiple = pad_token_id, pad_to_multiple
        self.settings, self.base_model, self.max_length = settings, base_model, max_length
        self.external_registered = False

    def shard(self, inputs: dict) -> ShardedBatch:
        return shard_trainer_batch(inputs, self.method, self.mesh.sp_rank, self.mesh.sp_size,
                                   self.ring_degree, self.pad_token_id, self.pad_to_multiple,
                                   model=self.base_model if self.vision else None)

    @property
    def vision(self) -> bool:
        """The model has a vision tower: batches with images are cut with it."""
        return is_vision_language(self.base_model)

    def check_batch(self, batch: dict, trainer) -> None:
        """Refuse, before any collective, a batch that this setup cannot train exactly."""
        if not (self.vision and has_vision_keys(batch)):
            check_batch_keys(batch)
            return
        check_vision_batch(batch, self.base_model)
        if not has_images(batch):  # text only (a processor's mm_token_type_ids): as text
            return
        # (FSDP2 and ZeRO-3 train with images: every rank runs the tower once per step, a
        # rank without image tokens on a dummy image: vision.vision_embeddings; max-length
        # mode runs its tiled decoder on the embeddings with the images' features:
        # vision.vision_language_loss)

    def text_through_tower(self, batch: ShardedBatch) -> ShardedBatch:
        """A text batch of a vision-language model whose tower is sharded (FSDP2, ZeRO-3)
        goes through the vision path with no images, so that this rank runs the tower once
        (on a dummy image) like the ranks of other data-parallel groups whose batches have
        images: their gathers and reductions would wait for it otherwise."""
        if batch.vision is None and self.vision and tower_sharded(self.base_model):
            return dataclasses.replace(batch, vision=VisionShard())
        return batch


def _unwrap_peft(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _refuse_accelerate_parallelism(trainer) -> None:
    config = getattr(trainer.accelerator, "parallelism_config", None) or getattr(
        trainer.args, "parallelism_config", None)
    if config is None:
        return
    on = [f"{name}={getattr(config, name)}" for name in ("cp_size", "sp_size", "tp_size")
          if (getattr(config, name, 1) or 1) > 1]
    if on:
        raise ValueError(
            f"accelerate's own parallelism is on ({', '.join(on)} in parallelism_config): it "
            "splits the sequence or the model itself, and two splits cannot share one "
            "sequence; drop parallelism_config (or set those sizes to 1) and let "
            "enable_sequence_parallel split the sequence")


# The Trainer methods that SequenceParallelMixin replaces: a script's own version of one of
# them would be skipped (the mixin comes first) or would run on the whole, unsharded batch.
REPLACED_METHODS = ("compute_loss", "prediction_step", "get_batch_samples", "evaluation_loop")


def _reproduced_classes() -> tuple[type, ...]:
    """The classes whose versions of REPLACED_METHODS the mixin reproduces."""
    from transformers import Trainer

    try:
        from trl import SFTTrainer
    except ImportError:
        return (Trainer,)
    return (Trainer, SFTTrainer)


def _refuse_overrides(cls: type) -> None:
    """A class that defines one of the replaced methods, other than transformers' Trainer and
    TRL's SFTTrainer (whose behaviour the mixin reproduces): refused, never skipped."""
    reproduced = _reproduced_classes() + (SequenceParallelMixin,)
    for name in REPLACED_METHODS:
        for klass in cls.__mro__:
            if name in vars(klass) and klass not in reproduced:
                raise ValueError(
                    f"{klass.__name__}.{name} overrides the Trainer's, which sequence-parallel "
                    f"training replaces (it runs on each rank's shard of the batch): drop the "
                    f"override, or move its logic out of {', '.join(REPLACED_METHODS)} (or build "
                    "on transformers' Trainer or TRL's SFTTrainer)")


def _streaming(data) -> bool:
    from torch.utils.data import IterableDataset

    if isinstance(data, IterableDataset):
        return True
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(data, datasets.IterableDataset)


def _refuse_unsupported_features(trainer, world: int, sp: int) -> None:
    """Trainer features that would run on a shard as if it were the whole sequence, or undo
    what enable_sequence_parallel installs: refused before anything is changed."""
    args = trainer.args
    if getattr(trainer, "model_init", None) is not None:
        raise ValueError("model_init is set: train() would build a new model without sequence "
                         "parallelism; pass model= instead")
    if getattr(args, "neftune_noise_alpha", None) is not None:
        raise ValueError(f"neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune scales its "
                         "noise by the sequence length, which each rank sees only a shard of; "
                         "set it to None")
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("use_liger_kernel=True: Liger's kernels replace the model's forward and "
                         "loss, which sequence parallelism computes; set it to False")
    if getattr(args, "torch_compile", False):
        raise ValueError("torch_compile=True is not supported with sequence parallelism; set it "
                         "to False")
    if sp > 1 and getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError("train_sampling_strategy='batch_rebalance' hands each rank its own "
                         "samples, but the ranks of a sequence-parallel group must share them; "
                         "use 'random' or 'group_by_length'")
    dp = world // sp if sp and world % sp == 0 else 1
    evals = trainer.eval_dataset
    evals = list(evals.values()) if isinstance(evals, dict) else [evals]
    for split, data in [("train_dataset", trainer.train_dataset)] + [("eval_dataset", e) for e in evals]:
        if dp > 1 and _streaming(data):
            raise ValueError(f"{split} is an IterableDataset (streaming) with {dp} data-parallel "
                             "groups, which are not tested to split it exactly; use a map-style "
                             "Dataset, or sp_size equal to the number of processes")


def _refuse_other_losses(trainer, base: nn.Module) -> None:
    """Losses that the exact chunked loss does not compute: refused, never replaced quietly."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError("compute_loss_func is set: sequence-parallel training computes the "
                         "causal-LM loss itself (on shards, without full logits); drop it")
    if getattr(trainer, "label_smoother", None) is not None:
        raise ValueError(f"label_smoothing_factor={trainer.args.label_smoothing_factor}: the "
                         "sequence-parallel loss is plain cross-entropy; set it to 0")
    loss_type = getattr(trainer.args, "loss_type", None)
    if loss_type not in (None, "nll"):
        raise ValueError(f"loss_type={loss_type!r}: the sequence-parallel loss is the token "
                         "mean of the negative log-likelihood; use loss_type='nll'")
    # TRL's SFTTrainer sets output_router_logits from its router_aux_loss_coef (overwriting
    # the model's), so a coefficient of 0 is what turns the auxiliary loss off under both.
    config = getattr(base, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = getattr(trainer, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if getattr(trainer, "aux_loss_enabled", False) or (
            getattr(config, "output_router_logits", False) and coef != 0):
        raise ValueError(f"the model's router auxiliary loss is on (router_aux_loss_coef={coef}): "
                         "the sequence-parallel loss does not add it; set router_aux_loss_coef=0.0 "
                         "(in SFTConfig under TRL, in the model's config under Trainer)")


def _pad_token_id(trainer, model: nn.Module) -> int:
    for owner in (getattr(trainer, "processing_class", None), getattr(model, "config", None)):
        value = getattr(owner, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return 0  # any id: padding added here is never attended to by a real token, nor trained


def _own_checkpointing(trainer, base: nn.Module, max_length: bool, checkpointing: str | None,
                       mlp_tile: int | None, head_chunk: int | None) -> None:
    """Max-length mode or one of our checkpointing kinds: they recompute the layers
    themselves, so the Trainer's gradient_checkpointing (which would replace the per-layer
    function at train()) is switched off, not run twice."""
    from ..memory.checkpointing import KINDS, apply_activation_checkpointing

    if checkpointing is not None and checkpointing not in KINDS:
        raise ValueError(f"checkpointing={checkpointing!r}; choose one of {KINDS}")
    if not max_length and checkpointing in (None, "none"):
        if mlp_tile is not None or head_chunk is not None:
            raise ValueError("mlp_tile and head_chunk are max-length mode's: pass max_length=True")
        return
    args = trainer.args
    if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
        log.info("gradient_checkpointing=True: easy_context's %s checkpoints the layers instead",
                 "max-length mode" if max_length else f"{checkpointing!r} checkpointing")
        # both names: gradient_checkpointing is an alias, train() reads activation_checkpointing
        args.gradient_checkpointing = False
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = False
    kind = checkpointing or "full"
    if not max_length:
        apply_activation_checkpointing(base, kind)
        return
    from ..memory.maxlen import apply_max_length, unsupported_reason

    # a PEFT model's adapted layers take max-length mode's generic path (maxlen.path_for),
    # which runs the layer's own modules, adapters included
    why = unsupported_reason(base)
    if why:
        raise ValueError(f"max_length=True: {why}")
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    apply_max_length(base, mlp_tile or 2048, head_chunk or config.num_attention_heads, kind)


def enable_sequence_parallel(trainer, method: str = "zigzag_ring_attn", sp_size: int | None = None,
                             ring_degree: int | None = None, *, max_length: bool = False,
                             mlp_tile: int | None = None, head_chunk: int | None = None,
                             checkpointing: str | None = None, pad_to_multiple: bool = True,
                             loss_chunk_size: int | None = None):
    """Make ``trainer`` (a transformers ``Trainer``, TRL ``SFTTrainer``, or a subclass) train
    and evaluate with ``method``'s sequence parallelism over groups of ``sp_size`` ranks
    (default: every rank; the rest of the world is data-parallel). Call it on every rank,
    after building the trainer and before ``train()``. Returns the trainer, changed in place.

    ``ring_degree``: USP's ring ranks per group. ``max_length``: max-length mode (MLP tiles of
    ``mlp_tile`` tokens, ``head_chunk`` query heads per attention chunk; full models only).
    ``checkpointing``: one of easy_context's kinds ("full", "offload", "attention"), instead of
    the Trainer's ``gradient_checkpointing``. ``pad_to_multiple``: pad a batch whose length the
    method cannot cut (exact), or refuse it. ``loss_chunk_size``: rows of logits per chunk.
    """
    if hasattr(trainer, "_easy_context"):
        raise ValueError("enable_sequence_parallel was already called on this trainer")
    _refuse_overrides(type(trainer))
    _refuse_accelerate_parallelism(trainer)
    world = trainer.accelerator.num_processes
    if world > 1 and not dist.is_initialized():
        raise RuntimeError(f"the trainer runs on {world} processes but torch.distributed is not "
                           "initialised; launch with accelerate launch or torchrun")
    sp = sp_size or world
    _refuse_unsupported_features(trainer, world, sp)
    mesh = build_mesh(sp, ring_degree if sp > 1 else None, device_type=trainer.args.device.type)
    name = get_method(method).name if sp > 1 else "local"
    model = trainer.model
    base = _unwrap_peft(model)
    check_model_supported(base)
    _refuse_other_losses(trainer, base)
    if not chunked_loss_possible(base):
        raise ValueError(f"{type(base).__name__}'s output head is not a linear layer, which the "
                         "sequence-parallel loss needs (it never builds the full logits)")
    apply_sequence_parallel(base, name, mesh.sp, ring_degree)
    _own_checkpointing(trainer, base, max_length, checkpointing, mlp_tile, head_chunk)
    settings = LossSettings(process_group(mesh.sp), chunked=True, chunk_size=loss_chunk_size)
    install_loss_forward(base, settings)
    trainer._easy_context = SequenceParallelState(
        mesh, name, ring_degree, _pad_token_id(trainer, base), pad_to_multiple, settings, base,
        max_length)
    # The loss below is already the mean over the accumulation steps: the Trainer must not
    # divide it again (both attributes: the first is the current name, the second the older
    # condition for the same decision).
    trainer.loss_is_scaled_for_ga = True
    trainer.model_accepts_loss_kwargs = True
    _shard_loaders_over_dp(trainer.accelerator, mesh)
    trainer.__class__ = _subclass(type(trainer))
    if mesh.rank == 0:
        log.info("sequence parallelism: %s, %s", name, mesh.describe())
    return trainer


def _shard_loaders_over_dp(accelerator, mesh: ParallelMesh) -> None:
    """Make ``accelerator.prepare`` shard data loaders over the data-parallel ranks only: the
    ranks of one sequence-parallel group then iterate the same batches. Batches are not
    dispatched from rank 0 (each group reads its own), so iterable datasets are sharded over
    the data-parallel ranks as well."""
    from accelerate.data_loader import prepare_data_loader

    original = accelerator.prepare_data_loader

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = accelerator.device_placement
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=mesh.dp, process_index=mesh.dp_rank,
            split_batches=accelerator.split_batches, put_on_device=device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=False,
            even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare


_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type) -> type:
    if issubclass(cls, SequenceParallelMixin):  # the script subclassed the mixin itself
        return cls
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"SequenceParallel{cls.__name__}", (SequenceParallelMixin, cls),
                                {"__module__": cls.__module__})
    return _SUBCLASSES[cls]


def _sum_over(values: Tensor, group) -> Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


class SequenceParallelMixin:
    """The Trainer methods that sequence parallelism changes (see the module docstring).
    ``enable_sequence_parallel`` puts it in front of the trainer's class; a script may also
    subclass it directly (``class MyTrainer(SequenceParallelMixin, SFTTrainer)``) and call
    ``enable_sequence_parallel`` on the instance all the same."""

    _easy_context: SequenceParallelState

    # -- training: the batches of one optimizer step and their exact count -------------
    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        for batch in batches:  # before the count's all-reduce: every rank refuses together
            self._easy_context.check_batch(batch, self)
        # int64 on the device (NCCL reduces device tensors only): never rounded, never cast
        count = torch.stack([count_targets(b).to(device) for b in batches]).sum()
        # each group's ranks hold the same batches: sum over the data-parallel ranks only
        return batches, _sum_over(count, self._easy_context.mesh.dp_group)

    # -- counts the Trainer logs: each group's batch once, as one process would count it ---
    def get_total_train_batch_size(self, args) -> int:
        # the Trainer's is micro-batch x accumulation x world size: sp_size times the samples
        # that one optimizer step takes (the ranks of a group share theirs)
        return super().get_total_train_batch_size(args) // self._easy_context.mesh.sp_size

    def floating_point_ops(self, inputs: dict) -> float:
        # every rank of a group is handed the whole batch; the Trainer sums over all ranks
        return super().floating_point_ops(inputs) / self._easy_context.mesh.sp_size

    def _track_num_input_tokens(self, inputs) -> None:
        # transformers gathers each rank's count of its (whole) batch: sp_size times each
        # group's; the sum is a multiple of sp_size, so the division is exact
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self._easy_context.mesh.sp_size

    def _register_zero3_external(self) -> None:
        """ZeRO-3 gathers a parameter when its own module runs; the chunked loss reads the
        head's weight (and in max-length mode the final norm's) without running them, so they
        are registered with the root module, which runs around the whole loss."""
        state = self._easy_context
        if state.external_registered or not getattr(self, "is_deepspeed_enabled", False):
            return
        state.external_registered = True
        if self.accelerator.state.deepspeed_plugin.zero_stage != 3:
            return
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        from ..memory.maxlen import loss_modules
        from .hf import output_head

        root = getattr(self.model_wrapped, "module", self.model_wrapped)
        head = output_head(state.base_model)[0]  # None for a BERT-style head: loss_modules
        params = list(head.parameters(recurse=False)) if head is not None else []
        if state.max_length:
            params += [p for m in loss_modules(state.base_model) for p in m.parameters()]
        for p in params:
            register_external_parameter(root, p)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        state = self._easy_context
        self._register_zero3_external()
        batch = state.text_through_tower(state.shard(inputs))
        training = self.model.training
        trl_metrics = hasattr(self, "_metrics")
        device = batch.input_ids.device
        state.settings.stats = torch.zeros(3, dtype=torch.float64, device=device) if trl_metrics else None
        images = {} if batch.vision is None else {"easy_context_vision": batch.vision}
        try:
            outputs = model(**batch.model_inputs(), easy_context_targets=batch.target_ids,
                            easy_context_num_items=num_items_in_batch if training else None,
                            **images)
            stats = state.settings.stats
        finally:
            state.settings.stats = None
        loss = outputs.loss
        if training:
            loss = self._scale_for_engine(loss, num_items_in_batch)
        if trl_metrics:
            self._record_trl_metrics(stats, inputs, training)
        return (loss, outputs) if return_outputs else loss

    def _scale_for_engine(self, loss: Tensor, num_items) -> Tensor:
        """The returned value is this group's share of the step's mean; its gradient is this
        rank's. DDP, FSDP2 and ZeRO-3 average gradients over all W ranks, so the gradient is
        taken W times; the Trainer averages the logged loss over the W ranks, of which every
        group has sp, so the value counts dp times (W / sp)."""
        mesh = self._easy_context.mesh
        world = self.accelerator.num_processes
        if num_items is None:  # a per-micro-batch mean: the Trainer would have divided it
            loss = loss / self.current_gradient_accumulation_steps
        return world * loss - (world - mesh.dp) * loss.detach()

    def _record_trl_metrics(self, stats: Tensor, inputs: dict, training: bool) -> None:
        """TRL's entropy and mean_token_accuracy over the whole batch (each rank adds its
        shard's sums), and num_tokens with each group's batch counted once."""
        mesh = self._easy_context.mesh
        mode = "train" if training else "eval"
        entropy, hits, valid = _sum_over(stats, None).tolist()
        self._metrics[mode]["entropy"].append(entropy / valid if valid else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(hits / valid if valid else 0.0)
        if training and hasattr(self, "_total_train_tokens"):
            mask = inputs.get("attention_mask")
            ids = inputs["input_ids"]
            tokens = mask.sum() if mask is not None else torch.tensor(ids.numel(), device=ids.device)
            self._total_train_tokens += int(_sum_over(tokens.reshape(1).long(), mesh.dp_group).item())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    # -- evaluation ------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        # without labels (predict() on prompts) there is no loss, as in the Trainer's own
        has_labels = inputs.get("labels") is not None or inputs.get("shift_labels") is not None
        self._easy_context.check_batch(inputs, self)  # evaluate() alone: refused here too
        if not prediction_loss_only and self._easy_context.vision and has_images(inputs):
            # logits of a step with images would need the vision path's own logits gather
            if self.compute_metrics is not None or not has_labels:
                raise ValueError("logits of batches with images (compute_metrics, predict()) "
                                 "are not gathered under sequence parallelism yet; evaluate "
                                 "the loss only (no compute_metrics)")
            prediction_loss_only = True  # nothing asked for the logits: the loss alone
        with torch.no_grad():
            if prediction_loss_only:
                if not has_labels:
                    return None, None, None
                return self.compute_loss(model, inputs).detach(), None, None
            return self._prediction_with_logits(model, inputs, has_labels)

    def _prediction_with_logits(self, model, inputs, has_labels: bool = True):
        """compute_metrics asked for logits: the model's own forward on the shard, the
        group's logits gathered in sequence order (B, S, V): memory the size of the full
        logits on every rank, as the metric asked."""
        from ..memory.loss import logits_cross_entropy
        from ..sequence_parallel import unshard_sequence

        state = self._easy_context
        mesh = state.mesh
        if not has_labels:  # targets that count nowhere, so the batch shards as any other
            inputs = {**inputs, "labels": torch.full_like(inputs["input_ids"], -100)}
        batch = state.shard(inputs)
        logits = model(**batch.model_inputs(), use_cache=False).logits
        loss = None
        if has_labels:
            loss = logits_cross_entropy(logits, batch.target_ids,
                                        group=process_group(mesh.sp)).detach()
        if mesh.sp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(mesh.sp_size)]
            dist.all_gather(parts, logits.contiguous(), group=process_group(mesh.sp))
            logits = unshard_sequence(torch.cat(parts, dim=1), state.method, mesh.sp_size,
                                      ring_degree=state.ring_degree)
        return loss, logits[:, :batch.length], inputs.get("labels") if has_labels else None

    def evaluation_loop(self, *args, **kwargs):
        # The Trainer gathers each batch's values from every rank; the ranks of a group hold
        # the same batch, so it would count each sp times (and cut the last batch wrongly).
        # transformers resets gather_function when the loop ends.
        self.gather_function = self._gather_one_per_group
        output = super().evaluation_loop(*args, **kwargs)
        # evaluate() and predict() then add speed_metrics to these metrics, counting
        # ceil(samples / (eval_batch_size x world size)) steps: sp_size times too few
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        dp_batch = self.args.eval_batch_size * self._easy_context.mesh.dp
        steps = math.ceil(output.num_samples / dp_batch) if output.num_samples else 0
        return output._replace(metrics=_StepsPerSecondFix(output.metrics, prefix, steps))

    def _gather_one_per_group(self, data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics, with one rank (sp rank 0) of each group."""
        from accelerate.utils import gather, recursively_apply

        mesh, state = self._easy_context.mesh, self.accelerator.gradient_state
        world = self.accelerator.num_processes
        if world == 1:
            return data
        if use_gather_object or not _all_tensors(data):
            objects = [None] * world
            dist.all_gather_object(objects, data)
            data = [x for obj in objects[::mesh.sp_size] for x in (obj if isinstance(obj, list) else [obj])]
        else:
            data = recursively_apply(
                lambda t: t.reshape(world, -1, *t.shape[1:])[::mesh.sp_size].flatten(0, 1),
                gather(data))
        if state.end_of_dataloader and state.remainder > 0:
            # the last batch was filled up with repeated samples (even_batches): drop them
            if isinstance(data, list):
                return data[:state.remainder]
            return recursively_apply(lambda t: t[:state.remainder], data)
        return data


class _StepsPerSecondFix(dict):
    """The evaluation loop's metrics. transformers' evaluate() and predict() update them with
    speed_metrics(num_steps=ceil(samples / (eval_batch_size x world size))) before logging
    them, returning them and handing them to the callbacks; the ranks of a group share their
    batches, so the loop ran ceil(samples / (eval_batch_size x dp)) steps. The update puts
    those steps over the same runtime (a plain dict otherwise: json, copies, pickling)."""

    def __init__(self, metrics: dict, prefix: str, steps: int):
        super().__init__(metrics)
        self._key = f"{prefix}_steps_per_second"
        self._runtime = f"{prefix}_runtime"
        self._steps = steps

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        runtime = self.get(self._runtime)
        if self._key in self and runtime:
            self[self._key] = round(self._steps / runtime, 3)

    def __reduce__(self):  # pickles (and deep-copies) as the plain dict it stands for
        return dict, (dict(self),)


def _all_tensors(data) -> bool:
    if isinstance(data, Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(x) for x in data)
    if isinstance(data, dict):
        return all(_all_tensors(x) for x in data.values())
    return False
