"""FSDP2 bf16 mixed precision keeps the loss denominator exact, on 1 and 2 gloo ranks.

FSDP2's root casts the floating-point tensors among its forward inputs to the compute dtype
(``MixedPrecisionPolicy.cast_forward_inputs``). The root is the loss module, and the step's
count of valid targets reaches it as a float64 tensor: bf16 turned 100001 into 99840, so the
default configuration's loss and gradients were 0.16% too large. The root now keeps its
inputs as they are (engines/fsdp.py), and the loss refuses a count in bf16 or fp16
(memory/loss.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.train_fixtures import tiny_model_dir

N = 100001  # the step's token count the trainer passes, far above bf16's exact integers


def denominator_errors(model_dir: str, chunked: bool) -> dict:
    """This rank: the loss and gradients with the count as a float64 tensor (what the
    trainer passes) against the same count as a Python int (which no wrapper casts)."""
    from easy_context.mesh import build_mesh
    from easy_context.train.config import TrainConfig
    from easy_context.train.trainer import build_model_and_engine

    rank = dist.get_rank()
    config = TrainConfig(model=model_dir, dataset="unused", output_dir="unused", seq_length=16,
                         parallel_mode="data_parallel", mixed_precision="bf16",
                         checkpointing="none", chunked_loss=chunked)
    _, engine = build_model_and_engine(config, torch.device("cpu"), build_mesh(1))
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(rank))
    batch = dict(input_ids=ids[:, :-1], position_ids=torch.arange(16)[None],
                 target_ids=ids[:, 1:].clone())
    batch["target_ids"][0, :3 * rank] = -100  # ranks hold different numbers of targets
    count = torch.tensor([float((batch["target_ids"] != -100).sum())], dtype=torch.float64)
    dist.all_reduce(count)

    def loss_and_grads(denominator):
        loss = engine.loss(**batch, group=dist.group.WORLD, num_items_in_batch=denominator)
        loss.backward()
        grads = [p.grad.to_local().clone() for p in engine.model.parameters()]
        engine.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), grads

    as_tensor, grads_tensor = loss_and_grads(torch.tensor([float(N)], dtype=torch.float64))
    as_int, grads_int = loss_and_grads(N)
    exact_mean, _ = loss_and_grads(count)  # the true token mean: sum / count
    return {
        # loss(N) * N / count must be the exact mean
        "loss": abs((as_tensor * N / count).item() / exact_mean.item() - 1),
        "tensor_vs_int": abs(as_tensor.item() / as_int.item() - 1),
        "grads_equal": all(torch.equal(a, b) for a, b in zip(grads_tensor, grads_int)),
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("precision") / "model"))


@pytest.mark.parametrize("pool_name", ["dist1", "dist2"])
@pytest.mark.parametrize("chunked", [True, False])
def test_bf16_keeps_the_token_count_exact(model_dir, pool_name, chunked, request):
    for r in request.getfixturevalue(pool_name).run(denominator_errors, model_dir, chunked):
        # 1e-6: float32 rounding of the loss value; the bug made this 1.6e-3
        assert r["loss"] <= 1e-6, r
        assert r["tensor_vs_int"] <= 1e-7, r
        assert r["grads_equal"], r
