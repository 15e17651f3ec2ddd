"""enable_sequence_parallel in transformers' Trainer and TRL's SFTTrainer, on 2 and 4 gloo
ranks against the same script in one process with transformers' own attention (sdpa).

One optimizer step of SGD with learning rate 1 and gradient accumulation 2 (4 for the one-
process reference of two data-parallel groups), so the weights after it are the weights
before minus the clipped gradient: every weight (or adapter) after the step, the logged
loss and the eval loss equal one process within 1e-5 (fp32; measured 0 to 3e-8), TRL's
entropy and token accuracy too where the micro-batches are the same (one data-parallel
group). Each method runs at least once; DDP, FSDP2 and DeepSpeed ZeRO-3; padded (right and
left), packed (DataCollatorWithFlattening, TRL packing) and unpacked batches; LoRA through a
PeftModel and through SFTTrainer's peft_config; max-length mode; resume from a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from .trainer_cases import error_of, load_plain, make_assets, run_trainer  # noqa: E402

TOL = 1e-5

# name: (world, options of the sequence-parallel run, accumulation of the one-process run)
CASES = {
    "trainer-padded-zigzag": (2, dict(kind="trainer"), 2),
    "trainer-packed-ulysses": (2, dict(kind="trainer", packing=True, method="ulysses_attn"), 2),
    "trainer-left-padded-ring": (2, dict(kind="trainer", padding_side="left",
                                         method="ring_attn"), 2),
    "sft-packed-zigzag": (2, dict(kind="sft", packing=True), 2),
    "sft-padded-allgather": (2, dict(kind="sft", method="allgather_attn"), 2),
    "sft-packed-lora": (2, dict(kind="sft", packing=True, lora=True), 2),
    "trainer-fsdp2-packed": (2, dict(kind="trainer", packing=True, engine="fsdp2"), 2),
    "trainer-fsdp2-lora-dist-flash": (2, dict(kind="trainer", packing=True, lora=True,
                                              engine="fsdp2", method="dist_flash_attn"), 2),
    "sft-deepspeed-packed-ulysses": (2, dict(kind="sft", packing=True, engine="deepspeed",
                                             method="ulysses_attn"), 2),
    "trainer-max-length": (2, dict(kind="trainer", packing=True, method="ulysses_attn",
                                   enable={"max_length": True, "mlp_tile": 8}), 2),
    "trainer-data-parallel-only": (2, dict(kind="trainer", sp_size=1), 4),
    "trainer-dp2-sp2-packed": (4, dict(kind="trainer", packing=True, sp_size=2), 4),
    "sft-usp-sp4": (4, dict(kind="sft", packing=True, method="usp_attn",
                            enable={"ring_degree": 2}), 2),
    "sft-deepspeed-dp2-sp2-left-padded-lora": (4, dict(kind="sft", engine="deepspeed",
                                                       padding_side="left", sp_size=2,
                                                       method="dist_flash_attn", lora=True), 4),
}
WRAPPER = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP", "deepspeed": "DeepSpeedEngine"}


@pytest.fixture(scope="module")
def assets(dist1, tmp_path_factory) -> str:
    return dist1.run(make_assets, str(tmp_path_factory.mktemp("hf-trainer")))[0]


_REFERENCES: dict[str, dict] = {}


def _reference(dist1, assets: str, options: dict, accum: int) -> dict:
    keep = ("kind", "packing", "lora", "padding_side")
    ref = {k: v for k, v in options.items() if k in keep}
    key = json.dumps({**ref, "accum": accum}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = dist1.run(run_trainer, assets, f"ref-{len(_REFERENCES)}",
                                     method=None, accum=accum, **ref)[0]
    return _REFERENCES[key]


def _largest_difference(a: dict, b: dict) -> float:
    # PEFT names the adapter ("...lora_A.default.weight") in a live model, not in a saved one
    b = {k.replace(".default.", "."): v for k, v in b.items()}
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(CASES))
def test_step_and_eval_equal_one_process(name, assets, dist1, dist2, dist4):
    world, options, accum = CASES[name]
    ref = _reference(dist1, assets, options, accum)
    got = (dist2 if world == 2 else dist4).run(run_trainer, assets, name, **options)[0]
    assert got["wrapped"].startswith(WRAPPER[options.get("engine", "ddp")]), got["wrapped"]
    assert abs(got["loss"] - ref["loss"]) <= TOL, (got["loss"], ref["loss"])
    assert abs(got["eval"]["eval_loss"] - ref["eval"]["eval_loss"]) <= TOL
    assert _largest_difference(ref["weights"], got["weights"]) <= TOL
    # the step moved the weights by far more than the tolerance: the comparison has teeth
    before = _initial_weights(assets, ref["weights"])
    assert _largest_difference(before, ref["weights"]) > 1e-3
    one_group = accum == 2
    if options["kind"] == "sft" and one_group:  # TRL's metrics, from the chunked loss
        for key in ("entropy", "mean_token_accuracy", "num_tokens"):
            assert abs(got["train_metrics"][key] - ref["train_metrics"][key]) <= TOL, key
        for key in ("eval_entropy", "eval_mean_token_accuracy"):
            assert abs(got["eval"][key] - ref["eval"][key]) <= TOL, key


def _initial_weights(assets: str, like: dict) -> dict:
    from safetensors.torch import load_file

    full = load_file(str(Path(assets) / "model" / "model.safetensors"))
    if all(k in full for k in like):
        return {k: full[k] for k in like}
    # adapters: B starts at zero, A at random; compare against the zero B only
    return {k: (0 * v if "lora_B" in k else v) for k, v in like.items()}


def test_resume_from_checkpoint_continues_exactly(assets, dist2):
    adam = {"optim": "adamw_torch", "learning_rate": 1e-2, "max_steps": 2,
            "save_strategy": "steps", "save_steps": 1}
    whole = dist2.run(run_trainer, assets, "resume-a", packing=True, args=adam,
                      evaluate=False)[0]
    resumed = dist2.run(run_trainer, assets, "resume-b", packing=True, args=adam,
                        evaluate=False, resume="resume-a/checkpoint-1")[0]
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
    (dict(lora=True, enable={"max_length": True}), "max_length=True with a PEFT model"),
    (dict(method="ulysses_attn", sp_size=2, enable={"ring_degree": 3}), "ring-degree 3"),
])
def test_bad_setups_are_refused_with_what_to_change(assets, dist2, options, message):
    errors = dist2.run(error_of, assets, "bad", evaluate=False, save=False, **options)
    assert all(message in e for e in errors), errors
