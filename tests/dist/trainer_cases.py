"""Rank functions for the Hugging Face Trainer / TRL integration tests.

Every run trains the same tiny Llama (saved once by :func:`make_assets`) for two optimizer
steps of SGD with learning rate LR and a gradient-norm clip MAX_NORM that bites (every
reference norm is above it), so the weights after them are the weights before minus LR x
the clipped gradients: comparing each tensor's change compares every gradient (LoRA's A
too: B is no longer zero at the second step). The reference runs the same script in one
process with transformers' own attention (sdpa), as a user without sequence parallelism
would.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

VOCAB = 96
PAD = VOCAB - 1
LR = 10.0
MAX_NORM = 0.05  # below every reference gradient norm (measured 0.06 to 0.83): clipping runs
# hybrid models saved beside the Llama (``model=`` picks one): gated DeltaNet, Mamba-2
HYBRID_MODELS = ("qwen3_next", "granite_hybrid")


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(VOCAB - 3)}
    vocab.update({"<unk>": VOCAB - 3, "<eos>": VOCAB - 2, "<pad>": PAD})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<pad>")


def make_assets(folder: str, seed: int = 0) -> str:
    """A tiny Llama and its tokenizer (``model/``), and train / eval token datasets of
    varied lengths (``train/``, ``eval/``) under ``folder``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = Path(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=PAD, eos_token_id=VOCAB - 2,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    from .hf_recurrent_cases import tiny_hybrid

    for family in HYBRID_MODELS:  # the same vocabulary and special tokens
        tiny_hybrid(family, seed, vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=VOCAB - 2,
                    tie_word_embeddings=False).save_pretrained(root / family)
        _tokenizer().save_pretrained(root / family)
    rng = random.Random(seed)
    for split, n in (("train", 32), ("eval", 8)):
        rows = [[rng.randrange(VOCAB - 3) for _ in range(rng.randrange(9, 40))] for _ in range(n)]
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / split))
    return str(root)


def _env_for_accelerate() -> None:
    """accelerate reads the launcher's variables (torchrun sets them); the pool's ranks share
    one initialised process group, which accelerate then reuses."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
    else:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        del os.environ[key]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _deepspeed_config(accum: int) -> dict:
    return {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}, "bf16": {"enabled": False},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto"}


def _args(out: Path, kind: str, engine: str, accum: int, batch: int, packing: bool, **extra):
    common = dict(output_dir=str(out), per_device_train_batch_size=batch,
                  per_device_eval_batch_size=batch, gradient_accumulation_steps=accum,
                  max_steps=2, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
                  weight_decay=0.0, max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, seed=3, disable_tqdm=True,
                  dataloader_drop_last=False, bf16=False, include_num_input_tokens_seen="all")
    common.update(extra)
    if engine == "deepspeed":
        common["deepspeed"] = _deepspeed_config(accum)
    if kind == "sft":
        from trl import SFTConfig

        return SFTConfig(max_length=64, packing=packing, **common)
    from transformers import TrainingArguments

    return TrainingArguments(remove_unused_columns=False, **common)


def _force_fsdp2(trainer) -> None:
    """accelerate 1.15 turns an FSDP config into DDP on a CPU (no FSDP in its MULTI_CPU
    branch), so the state is switched after the fact: what accelerate launch with an FSDP2
    config sets up on GPUs (prepare then calls fully_shard per decoder layer and the root)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            state_dict_type="FULL_STATE_DICT",
                                            cpu_ram_efficient_loading=False)
    plugin.set_auto_wrap_policy(trainer.model)
    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    # as accelerate's own FSDP setup does: every later AcceleratorState() copies PartialState's
    # distributed_type over its own; left MULTI_CPU there, save_model's get_state_dict took
    # the non-FSDP branch and handed safetensors the sharded DTensors ("invalid python storage")
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True


def run_trainer(folder: str, name: str, **kwargs) -> dict:
    """:func:`train_and_evaluate`, leaving nothing behind in the pool's rank: TrainingArguments
    with a DeepSpeed config make transformers build every later model under ZeRO-3's
    zero.Init (a module-level weak reference), and accelerate keeps its state in singletons."""
    import gc

    try:
        return train_and_evaluate(folder, name, **kwargs)
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        gc.collect()
        _env_for_accelerate()


def train_and_evaluate(folder: str, name: str, kind: str = "trainer", engine: str = "ddp",
                method: str | None = "zigzag_ring_attn", sp_size: int | None = None,
                accum: int = 2, batch: int = 2, packing: bool = False, lora: bool = False,
                padding_side: str = "right", evaluate: bool = True, enable: dict | None = None,
                save: bool = True, args: dict | None = None, resume: str | None = None,
                predict: bool = False, override: str | None = None, model_init: bool = False,
                streaming: bool = False, extra_column: str | None = None,
                mixin_first: bool = False, model_name: str = "model") -> dict:
    """Train two steps (and evaluate) with ``kind`` ("trainer": transformers' Trainer with
    DataCollatorWithFlattening when ``packing``, else padded batches; "sft": TRL's SFTTrainer)
    on ``engine`` ("ddp", "fsdp2", "deepspeed"). ``method=None`` is the one-process reference.
    ``args`` override TrainingArguments; ``resume``: a checkpoint folder name to resume from;
    ``predict``: predict() the eval set without labels after training. Setups to refuse:
    ``override`` (a method the script's Trainer subclass defines), ``model_init``,
    ``streaming`` (an IterableDataset), ``extra_column`` (a batch key that is not sharded).
    ``mixin_first``: the script's class is ``(SequenceParallelMixin, Trainer)`` itself.
    ``model_name``: the folder of the model to train (``model``: the Llama; HYBRID_MODELS).
    Returns, on rank 0, the logged losses and gradient norms, eval loss, TRL metrics, the
    Trainer's counts, the weights before and after (saved)."""
    import datasets
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _env_for_accelerate()
    root = Path(folder)
    out = root / name
    tokenizer = _tokenizer()
    tokenizer.padding_side = padding_side
    model = AutoModelForCausalLM.from_pretrained(root / model_name, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    train = datasets.load_from_disk(str(root / "train"))
    evals = datasets.load_from_disk(str(root / "eval"))
    if extra_column is not None:
        train = train.map(lambda row: {extra_column: [0] * len(row["input_ids"])})
    if streaming:
        train = train.to_iterable_dataset()
    peft_config = None
    if lora:
        from peft import LoraConfig

        # (in_proj*, out_proj: the hybrids' recurrent layers, gated DeltaNet and Mamba-2)
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=[
                                     "q_proj", "v_proj", "in_proj_qkvz", "in_proj", "out_proj"],
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    args = _args(out, kind, engine, accum, batch, packing, **(args or {}))
    if kind == "sft":
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals,
                             processing_class=tokenizer, peft_config=peft_config)
    else:
        from transformers import (DataCollatorForLanguageModeling, DataCollatorWithFlattening,
                                  Trainer)

        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        collator = (DataCollatorWithFlattening() if packing else
                    DataCollatorForLanguageModeling(tokenizer, mlm=False))
        cls = Trainer
        if override is not None:  # a script's own subclass
            cls = type("ScriptTrainer", (Trainer,), {override: _script_override(override)})
        if mixin_first:
            from easy_context.integrations.trainer import SequenceParallelMixin

            cls = type("ScriptTrainer", (SequenceParallelMixin, Trainer), {})
        built = model
        trainer = cls(model=None if model_init else model,
                      model_init=(lambda: built) if model_init else None, args=args,
                      train_dataset=train, eval_dataset=evals, data_collator=collator)
    if engine == "fsdp2":
        _force_fsdp2(trainer)
    if method is not None:
        from easy_context import enable_sequence_parallel

        enable_sequence_parallel(trainer, method, sp_size, **(enable or {}))
    initial = _trainable_weights(trainer.model, lora)
    trainer.train(resume_from_checkpoint=None if resume is None else str(root / resume))
    history = trainer.state.log_history
    unwrapped = getattr(trainer.model, "get_base_model", lambda: trainer.model)()
    result = {"loss": history[0]["loss"],
              "losses": [h["loss"] for h in history if "loss" in h],
              "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
              "initial": initial,
              "wrapped": type(trainer.model_wrapped).__name__,
              "checkpointing": _checkpointing_of(unwrapped),
              "counts": {"total_flos": trainer.state.total_flos,
                         "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
                         "total_train_batch_size": trainer.get_total_train_batch_size(trainer.args)},
              "train_metrics": {k: v for k, v in history[0].items()
                                if k in ("entropy", "mean_token_accuracy", "num_tokens")}}
    if evaluate:
        metrics = trainer.evaluate()
        result["eval"] = {k: v for k, v in metrics.items()
                          if k in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")}
        # the steps and samples that the speed metrics divide by (runtime: 4 decimals)
        result["counts"]["eval_steps"] = _speed_count(metrics, "eval", "steps")
        result["counts"]["eval_samples"] = _speed_count(metrics, "eval", "samples")
    if predict:  # prompts without labels: logits only, no loss
        from transformers import DataCollatorWithPadding

        trainer.data_collator = DataCollatorWithPadding(tokenizer)
        predicted = trainer.predict(evals)
        logits = torch.as_tensor(predicted.predictions)  # (rows, longest, V)
        for row, ids in enumerate(evals["input_ids"]):  # padding's logits mean nothing
            logits[row, len(ids):] = 0
        result["counts"]["test_steps"] = _speed_count(predicted.metrics, "test", "steps")
        result["counts"]["test_samples"] = _speed_count(predicted.metrics, "test", "samples")
        result["predict"] = {"predictions": logits,
                             "label_ids": predicted.label_ids,
                             "loss": predicted.metrics.get("test_loss")}
    if engine == "fsdp2":
        # the trained weights, gathered by torch itself, to compare save_model's file with
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(trainer.model_wrapped,
                                    options=StateDictOptions(full_state_dict=True))
        result["gathered"] = {k: v.detach().clone() for k, v in full.items()
                              if not lora or "lora_" in k}
    if save:
        trainer.save_model(str(out / "saved"))
    if dist.is_initialized():
        dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return {}
    if save:
        file = "adapter_model.safetensors" if lora else "model.safetensors"
        result["weights"] = load_file(str(out / "saved" / file))
        result["saved"] = str(out / "saved")
    return result


def _speed_count(metrics: dict, prefix: str, what: str) -> int:
    """The count that ``{prefix}_{what}_per_second`` divides by: the rate times the runtime
    (rounded to 3 and 4 decimals; the runtime of a few forwards is over 10 ms, so the
    product is within 1% of the whole count)."""
    return round(metrics[f"{prefix}_{what}_per_second"] * metrics[f"{prefix}_runtime"])


def _trainable_weights(model, lora: bool) -> dict:
    """The weights that training changes, named as the saved file names them."""
    return {k.replace(".default.", "."): v.detach().clone()
            for k, v in model.state_dict().items() if not lora or "lora_" in k}


def _checkpointing_of(model) -> list[str]:
    """How the layers that transformers checkpoints are checkpointed: the names of their
    checkpoint functions (our offload's, torch's checkpoint with our saving context, ...)."""
    names = set()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            function = module._gradient_checkpointing_func
            name = getattr(function, "func", function).__name__
            if "context_fn" in getattr(function, "keywords", {}):
                name += "+context_fn"
            names.add(name)
    return sorted(names)


def _script_override(name: str):
    """A script's own version of a Trainer method: defers to the Trainer's (the refusal
    comes before any is called)."""
    def method(self, *args, **kwargs):
        return getattr(super(type(self), self), name)(*args, **kwargs)

    return method


def error_of(folder: str, name: str, **kwargs) -> str:
    """The message of the error that ``run_trainer(**kwargs)`` raises (on this rank)."""
    try:
        run_trainer(folder, name, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def load_plain(saved: str) -> dict:
    """A saved model loaded the way a user without easy_context would: no attention named."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    ids = torch.arange(12).unsqueeze(0)
    return {"attention": model.config._attn_implementation,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "logits": model(input_ids=ids).logits.detach()}


def moe_aux_loss_outcomes(folder: str) -> dict:
    """What enable_sequence_parallel says to a tiny Mixtral whose router auxiliary loss is
    on (SFTTrainer's default coefficient), off through SFTConfig(router_aux_loss_coef=0.0),
    and off under Trainer through the model config's coefficient with output_router_logits
    still on."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from easy_context import enable_sequence_parallel

    _env_for_accelerate()
    root = Path(folder)
    train = datasets.load_from_disk(str(root / "train"))
    common = dict(output_dir=str(root / "moe"), report_to=[], use_cpu=True, max_steps=1)

    def model(**config):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, pad_token_id=PAD, **config))

    def outcome(build) -> str:
        try:
            enable_sequence_parallel(build())
        except ValueError as e:
            return f"ValueError: {e}"
        finally:
            _env_for_accelerate()
        return "enabled"

    return {
        "sft-default": outcome(lambda: SFTTrainer(
            model=model(), args=SFTConfig(max_length=64, **common), train_dataset=train,
            processing_class=_tokenizer())),
        "sft-coef-0": outcome(lambda: SFTTrainer(
            model=model(), args=SFTConfig(max_length=64, router_aux_loss_coef=0.0, **common),
            train_dataset=train, processing_class=_tokenizer())),
        "trainer-config-coef-0": outcome(lambda: Trainer(
            model=model(output_router_logits=True, router_aux_loss_coef=0.0),
            args=TrainingArguments(**common), train_dataset=train)),
    }
