"""enable_sequence_parallel in transformers' Trainer and TRL's SFTTrainer, on 2 and 4 gloo
ranks against the same script in one process with transformers' own attention (sdpa).

Two optimizer steps of SGD (learning rate LR) with a gradient-norm clip that bites at both,
gradient accumulation 2 (4 for the one-process reference of two data-parallel groups), so the
weights after them are the weights before minus LR x the clipped gradients: every tensor's
change (adapters: A and B) equals one process's within REL (relative to that change's norm;
fp32), the logged losses, gradient norms (before clipping) and eval loss within TOL, TRL's
entropy and token accuracy too where the micro-batches are the same (one data-parallel group),
and the Trainer's counts (tokens seen, total flos, total batch size, which samples/s divides;
the samples and steps that evaluate's and predict's speed metrics divide by) equal one
process's. Each method runs at least once; DDP, FSDP2 and DeepSpeed ZeRO-3; padded
(right and left), packed (DataCollatorWithFlattening, TRL packing) and unpacked batches; LoRA
through a PeftModel and through SFTTrainer's peft_config; max-length mode; bf16; the
Trainer's gradient_checkpointing beside our own checkpointing; predict() without labels;
resume from a checkpoint (one and two data-parallel groups); under FSDP2, save_model's file
holds the trained weights (the full model and LoRA's adapters). Hybrid models (Qwen3-Next's
gated DeltaNet, Granite 4's Mamba-2; LoRA on their recurrent layers' projections too) with
the Trainer and SFTTrainer, DDP, FSDP2 and DeepSpeed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

import torch  # noqa: E402

from .trainer_cases import (MAX_NORM, error_of, load_plain, make_assets,  # noqa: E402
                           moe_aux_loss_outcomes, run_trainer)

TOL = 1e-5
# each tensor's change after two steps, relative to its norm (fp32). Measured: at most
# 1.0e-4 (a norm's weights, ~1, moved by ~1e-3: float32 rounds them to 1e-7), 5e-6 for the
# others; a 5% error in the smallest gradients (q/k) is 50x this bound.
REL = 1e-3
# bf16 autocast in both runs: different reduction orders and shard boundaries round
# differently at 8 bits of mantissa. Measured: at most 7.1e-3 relative per tensor, 4e-5 on
# the losses and gradient norms (bounded by BF16_TOL).
REL_BF16 = 3e-2
BF16_TOL = 1e-2

# name: (world, options of the sequence-parallel run, accumulation of the one-process run)
CASES = {
    "trainer-padded-zigzag": (2, dict(kind="trainer", predict=True), 2),
    "trainer-offload-gradient-checkpointing": (2, dict(
        kind="trainer", args={"gradient_checkpointing": True},
        enable={"checkpointing": "offload"}), 2),
    "sft-packed-bf16": (2, dict(kind="sft", packing=True, args={"bf16": True}), 2),
    "trainer-packed-ulysses": (2, dict(kind="trainer", packing=True, method="ulysses_attn"), 2),
    "trainer-left-padded-ring-mixin-first": (2, dict(kind="trainer", padding_side="left",
                                                     method="ring_attn", mixin_first=True), 2),
    "sft-packed-zigzag": (2, dict(kind="sft", packing=True), 2),
    "sft-padded-allgather": (2, dict(kind="sft", method="allgather_attn"), 2),
    "sft-packed-lora": (2, dict(kind="sft", packing=True, lora=True), 2),
    "trainer-fsdp2-packed": (2, dict(kind="trainer", packing=True, engine="fsdp2"), 2),
    "trainer-fsdp2-lora-dist-flash": (2, dict(kind="trainer", packing=True, lora=True,
                                              engine="fsdp2", method="dist_flash_attn"), 2),
    "sft-deepspeed-packed-ulysses": (2, dict(kind="sft", packing=True, engine="deepspeed",
                                             method="ulysses_attn"), 2),
    "trainer-max-length": (2, dict(kind="trainer", packing=True, method="ulysses_attn",
                                   args={"gradient_checkpointing": True},
                                   enable={"max_length": True, "mlp_tile": 8}), 2),
    # a PeftModel in max-length mode: the adapted layers take the generic path (the
    # refusal "max_length=True with a PEFT model" before)
    "trainer-max-length-lora": (2, dict(kind="trainer", packing=True, lora=True,
                                        enable={"max_length": True, "mlp_tile": 8,
                                                "head_chunk": 2}), 2),
    "trainer-data-parallel-only": (2, dict(kind="trainer", sp_size=1), 4),
    "trainer-dp2-sp2-packed": (4, dict(kind="trainer", packing=True, sp_size=2), 4),
    "sft-usp-sp4": (4, dict(kind="sft", packing=True, method="usp_attn",
                            enable={"ring_degree": 2}), 2),
    "sft-deepspeed-dp2-sp2-left-padded-lora": (4, dict(kind="sft", engine="deepspeed",
                                                       padding_side="left", sp_size=2,
                                                       method="dist_flash_attn", lora=True), 4),
    # hybrid models (recurrent layers routed by apply_sequence_parallel): gated DeltaNet,
    # Mamba-2. Unpacked: packed, the recurrent layers restart at each document here while
    # transformers' CPU path in one process carries their state across documents
    # (hf_recurrent_cases.check_hybrid_documents checks packing against documents alone)
    "trainer-padded-zigzag-qwen3-next": (2, dict(kind="trainer", model_name="qwen3_next"), 2),
    # (router_aux_loss_coef=0: TRL turns the router loss on for any config that has one,
    # and these have no expert layer: transformers fails on the empty router logits)
    "sft-left-padded-ulysses-lora-qwen3-next": (2, dict(
        kind="sft", padding_side="left", method="ulysses_attn", lora=True,
        model_name="qwen3_next", args={"router_aux_loss_coef": 0.0}), 2),
    # LoRA: Mamba-2's A_log and dt_bias get gradients of ~1e-7 here, too small to move
    # their float32 weights in two steps, so a full-weight run has no change to compare
    "trainer-fsdp2-padded-lora-granite-hybrid": (2, dict(kind="trainer", engine="fsdp2",
                                                         lora=True, model_name="granite_hybrid"), 2),
    "sft-deepspeed-lora-granite-hybrid": (2, dict(
        kind="sft", engine="deepspeed", lora=True, model_name="granite_hybrid",
        args={"router_aux_loss_coef": 0.0}), 2),
}
# the checkpoint functions of the layers that transformers checkpoints, after train()
CHECKPOINTING = {"trainer-offload-gradient-checkpointing": ["_offloaded_checkpoint"],
                 "trainer-max-length": [], "trainer-max-length-lora": []}
WRAPPER = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP", "deepspeed": "DeepSpeedEngine"}


@pytest.fixture(scope="module")
def assets(dist1, tmp_path_factory) -> str:
    return dist1.run(make_assets, str(tmp_path_factory.mktemp("hf-trainer")))[0]


_REFERENCES: dict[str, dict] = {}


def _reference(dist1, assets: str, options: dict, accum: int) -> dict:
    keep = ("kind", "packing", "lora", "padding_side", "args", "predict", "model_name")
    ref = {k: v for k, v in options.items() if k in keep}
    key = json.dumps({**ref, "accum": accum}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = dist1.run(run_trainer, assets, f"ref-{len(_REFERENCES)}",
                                     method=None, accum=accum, **ref)[0]
    return _REFERENCES[key]


def _named(weights: dict) -> dict:
    # PEFT names the adapter ("...lora_A.default.weight") in a live model, not in a saved one
    return {k.replace(".default.", "."): v for k, v in weights.items()}


def _largest_difference(a: dict, b: dict) -> float:
    """The largest absolute difference over all tensors; NaN if any is NaN."""
    a, b = _named(a), _named(b)
    assert sorted(a) == sorted(b)
    worst = torch.zeros((), dtype=torch.float64)
    for k in a:
        worst = torch.maximum(worst, (a[k].double() - b[k].double()).abs().max())
    return float(worst)


def _change_errors(before: dict, ref: dict, got: dict) -> dict[str, tuple[float, float]]:
    """Per tensor: (|change_got - change_ref| / |change_ref|, |change_ref|), Frobenius norms
    of the changes that training made to it (NaN stays NaN)."""
    before, ref, got = _named(before), _named(ref), _named(got)
    assert sorted(ref) == sorted(got) and set(ref) <= set(before), (sorted(ref), sorted(got))
    out = {}
    for k in ref:
        change = ref[k].double() - before[k].double()
        error = (got[k].double() - ref[k].double()).norm()
        out[k] = (float(error / change.norm()), float(change.norm()))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_steps_and_eval_equal_one_process(name, assets, dist1, dist2, dist4):
    world, options, accum = CASES[name]
    ref = _reference(dist1, assets, options, accum)
    got = (dist2 if world == 2 else dist4).run(run_trainer, assets, name, **options)[0]
    bf16 = options.get("args", {}).get("bf16", False)
    tol = BF16_TOL if bf16 else TOL
    assert got["wrapped"].startswith(WRAPPER[options.get("engine", "ddp")]), got["wrapped"]
    assert _largest_difference(ref["initial"], got["initial"]) == 0.0
    # gradient_checkpointing=True beside our checkpointing: ours stays as it was set up
    if name in CHECKPOINTING:
        assert got["checkpointing"] == CHECKPOINTING[name], got["checkpointing"]
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for key in ("losses", "grad_norms"):
        for a, b in zip(got[key], ref[key]):
            assert abs(a - b) <= tol * max(1.0, abs(b)), (key, got[key], ref[key])
    # clipping ran at both steps: the gradients enter the weights through it
    assert all(norm > MAX_NORM for norm in ref["grad_norms"]), ref["grad_norms"]
    assert abs(got["eval"]["eval_loss"] - ref["eval"]["eval_loss"]) <= tol
    errors = _change_errors(ref["initial"], ref["weights"], got["weights"])
    bound = REL_BF16 if bf16 else REL
    assert not [k for k, (error, _) in errors.items() if not error <= bound], errors
    # every tensor moved (LoRA's A included), so each comparison has teeth
    assert all(change > 0 for _, change in errors.values()), errors
    if "gathered" in got:  # FSDP2: save_model's file holds the weights that torch gathers
        assert _largest_difference(got["gathered"], got["weights"]) == 0.0
    # the counts one process logs: each group's batch once. Not total_flos under ZeRO-3:
    # transformers counts it from param.numel() of the partitioned parameters there
    # (measured 0.78x the one-process count without ZeRO-3).
    one_group = accum == 2
    for key, value in ref["counts"].items():
        if key == "total_flos" and options.get("engine") == "deepspeed":
            continue
        if key.endswith("_steps") and not one_group:  # two groups evaluate side by side
            value = math.ceil(value / 2)
        assert got["counts"][key] == value, (key, got["counts"], ref["counts"])
    if options.get("predict"):  # predict() on prompts without labels: logits, no loss
        assert got["predict"]["label_ids"] is None and got["predict"]["loss"] is None
        predicted, expected = got["predict"]["predictions"], ref["predict"]["predictions"]
        assert predicted.shape == expected.shape
        assert float((predicted.double() - expected.double()).abs().max()) <= TOL
    if options["kind"] == "sft" and one_group:  # TRL's metrics, from the chunked loss
        for key in ("entropy", "mean_token_accuracy", "num_tokens"):
            assert abs(got["train_metrics"][key] - ref["train_metrics"][key]) <= tol, key
        for key in ("eval_entropy", "eval_mean_token_accuracy"):
            assert abs(got["eval"][key] - ref["eval"][key]) <= tol, key


@pytest.mark.parametrize("world, sp_size", [(2, None), (4, 2)], ids=["sp2", "dp2-sp2"])
def test_resume_from_checkpoint_continues_exactly(world, sp_size, assets, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    adam = {"optim": "adamw_torch", "learning_rate": 1e-2, "max_steps": 2,
            "save_strategy": "steps", "save_steps": 1}
    whole = pool.run(run_trainer, assets, f"resume-a-{world}", packing=True, args=adam,
                     evaluate=False, sp_size=sp_size)[0]
    resumed = pool.run(run_trainer, assets, f"resume-b-{world}", packing=True, args=adam,
                       evaluate=False, sp_size=sp_size, resume=f"resume-a-{world}/checkpoint-1")[0]
    assert resumed["losses"] == whole["losses"]
    assert _largest_difference(whole["weights"], resumed["weights"]) == 0.0


def test_saved_model_loads_in_plain_transformers(assets, dist1, dist2):
    got = dist2.run(run_trainer, assets, "saved", evaluate=False)[0]
    config = (Path(got["saved"]) / "config.json").read_text()
    assert "zigzag" not in config and "_attn_implementation" not in config
    plain = dist1.run(load_plain, got["saved"])[0]
    assert plain["attention"] == "sdpa"
    assert _largest_difference(got["weights"], plain["weights"]) == 0.0


@pytest.mark.parametrize("options, message", [
    (dict(args={"label_smoothing_factor": 0.1}), "label_smoothing_factor=0.1"),
    (dict(enable={"pad_to_multiple": False}), "pad_to_multiple_of=4"),
    (dict(enable={"checkpointing": "sometimes"}), "checkpointing='sometimes'"),
    (dict(method="ulysses_attn", sp_size=2, enable={"ring_degree": 3}), "ring-degree 3"),
    # a script's own Trainer methods that the mixin would replace
    (dict(override="compute_loss"), "ScriptTrainer.compute_loss overrides"),
    (dict(override="prediction_step"), "ScriptTrainer.prediction_step overrides"),
    (dict(override="get_batch_samples"), "ScriptTrainer.get_batch_samples overrides"),
    (dict(override="evaluation_loop"), "ScriptTrainer.evaluation_loop overrides"),
    # Trainer features that would see a shard as the whole, or undo the setup
    (dict(args={"neftune_noise_alpha": 5.0}), "neftune_noise_alpha=5.0"),
    (dict(args={"use_liger_kernel": True}), "use_liger_kernel=True"),
    (dict(args={"torch_compile": True}), "torch_compile=True"),
    (dict(model_init=True), "model_init is set"),
    (dict(args={"train_sampling_strategy": "batch_rebalance"}), "'batch_rebalance'"),
    (dict(streaming=True, sp_size=1), "IterableDataset"),
    (dict(extra_column="token_type_ids"), "carries ['token_type_ids']"),
])
def test_bad_setups_are_refused_with_what_to_change(assets, dist2, options, message):
    errors = dist2.run(error_of, assets, "bad", evaluate=False, save=False, **options)
    assert all(message in e for e in errors), errors


def test_moe_aux_loss_refusal_names_the_coefficient_that_turns_it_off(assets, dist1):
    """TRL overwrites output_router_logits from its router_aux_loss_coef: the refusal names
    the coefficient, and a coefficient of 0 is accepted under SFTTrainer and Trainer."""
    got = dist1.run(moe_aux_loss_outcomes, assets)[0]
    assert "set router_aux_loss_coef=0.0" in got["sft-default"], got
    assert got["sft-coef-0"] == "enabled", got
    assert got["trainer-config-coef-0"] == "enabled", got
