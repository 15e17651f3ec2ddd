"""The DeepSpeed ZeRO-3 engine trains exactly like the FSDP engine, on 2 gloo ranks.

Same tiny llama, same data, zigzag_ring_attn over both ranks, fp32, full activation
checkpointing: the per-step losses (and gradient norms) of --engine deepspeed equal those of
--engine fsdp, with and without optimizer offload, with gradient accumulation, and across a
checkpoint + resume. The exported model loads with from_pretrained and equals FSDP's export.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir  # noqa: E402

SEQ = 64


def ds_train(workdir: str, name: str, **overrides) -> list[dict]:
    """Rank function: train the tiny model; rank 0 returns its per-step metrics."""
    import torch.distributed as dist

    from easy_context.train.config import TrainConfig
    from easy_context.train.trainer import results_of, run_training

    work = Path(workdir)
    values = dict(model=str(work / "model"), dataset=str(work / "data"), seq_length=SEQ,
                  max_train_steps=3, learning_rate=1e-3, output_dir=str(work / name),
                  mixed_precision="fp32", checkpointing="full", seed=7,
                  parallel_mode="zigzag_ring_attn")
    values.update(overrides)
    config = TrainConfig(**values)
    config.validate()
    run_training(config)
    dist.barrier()
    return results_of(config.output_dir) if dist.get_rank() == 0 else []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("ds_train")
    tiny_model_dir(work / "model")
    tiny_dataset_dir(work / "data", SEQ, rows=16)
    return str(work)


def _assert_same_losses(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for i, (g, w) in enumerate(zip(got, want)):
        tol = 1e-5 if i == 0 else 1e-4
        assert g["loss"] == pytest.approx(w["loss"], rel=tol), (i, got, want)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), (i, got, want)


@pytest.fixture(scope="module")
def fsdp_reference(dist2, workdir) -> list[dict]:
    return dist2.run(ds_train, workdir, "fsdp", engine="fsdp")[0]


@pytest.mark.slow
def test_deepspeed_equals_fsdp_and_exports(dist2, workdir, fsdp_reference):
    got = dist2.run(ds_train, workdir, "ds", engine="deepspeed")[0]
    _assert_same_losses(got, fsdp_reference)
    assert got[-1]["loss"] < got[0]["loss"]

    import torch
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(Path(workdir) / "ds" / "final_model")
    ref = AutoModelForCausalLM.from_pretrained(Path(workdir) / "fsdp" / "final_model")
    assert {p.suffix for p in (Path(workdir) / "ds" / "final_model").iterdir()} <= {
        ".json", ".safetensors"}
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    for key in ref_sd:
        assert ours_sd[key].dtype == torch.float32, key
        torch.testing.assert_close(ours_sd[key], ref_sd[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
def test_offload_optimizer_with_accumulation_and_resume(dist2, workdir):
    """--offload optimizer, 2 micro-batches per step: equals FSDP; a run stopped after step 2
    and resumed from its DeepSpeed checkpoint gives the same step 3."""
    accum = dict(gradient_accumulate_every=2)
    want = dist2.run(ds_train, workdir, "fsdp_acc", engine="fsdp", **accum)[0]
    got = dist2.run(ds_train, workdir, "ds_off", engine="deepspeed", offload="optimizer",
                    **accum)[0]
    _assert_same_losses(got, want)

    dist2.run(ds_train, workdir, "ds_resume", engine="deepspeed", offload="optimizer",
              max_train_steps=2, **accum)
    resumed = dist2.run(ds_train, workdir, "ds_resume", engine="deepspeed", offload="optimizer",
                        resume=True, **accum)[0]
    assert resumed[-1]["step"] == 3
    assert resumed[-1]["loss"] == pytest.approx(got[-1]["loss"], rel=1e-5)
