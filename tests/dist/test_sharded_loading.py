"""Training builds the model empty and fills each rank's shards from the checkpoint
(easy_context.train.weights): no rank ever holds the whole model.

Exactness: the loaded weights are bit-equal to ``from_pretrained``'s, for FSDP on 1, 2 and 4
ranks (rows not divisible by the world, tied embeddings, bf16 and fp32 checkpoints), for
DeepSpeed zero.Init on 2 (fp32, and bf16 with fp32 rotary tables), and for a checkpoint
only transformers can map (Mixtral: its per-expert tensors are fused on load), which rank 0
loads and the engine broadcasts.

Memory, measured from outside (VmRSS and VmHWM in /proc/self/status of each rank), for a
model of M = 288 MB in fp32, stored in bf16 as hub checkpoints are, on 2 ranks, in fresh
processes with MALLOC_MMAP_THRESHOLD_ set so that freed blocks go back to the OS:

- FSDP: after setup a rank holds M/2 more than before it (its shards; measured 144.5 MB),
  and at no point more than M/2 plus the largest tensor (64 MB; measured peak +160 MB).
  Before this change: the same after setup, but a peak of +432 MB (1.5 M: the whole fp32
  model plus the bf16 file) on every rank.
- DeepSpeed: when deepspeed.initialize starts, the model is built and loaded and a rank
  holds M/2 more (measured +145 MB; before: +289 MB, the whole model), and at most M/2 plus
  two copies of the largest tensor while loading (one parameter is gathered at a time;
  measured +273 MB; before: +433 MB). What initialize itself adds (fp32 master partitions,
  gradient buffers) is DeepSpeed's and unchanged.

Tolerances: the bounds below are those figures' theory (M/2, the largest tensor L) plus
16-48 MB for allocator and readahead noise; a whole model on a rank (M = 288 MB) exceeds
each of them.
"""

from __future__ import annotations

import pytest
import torch

from easy_context.testing import DistPool
from tests.train_fixtures import tiny_model_dir

from .loading_cases import loaded_differences, setup_memory

BIG = dict(vocab_size=16384, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=8, head_dim=128)
M_MB = 4 * (2 * 16384 * 1024 + 4 * (4 * 1024 * 1024 + 3 * 1024 * 2048) + 9 * 1024) / 2**20
L_MB = 4 * 16384 * 1024 / 2**20  # the largest tensor (embedding, head), fp32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    work = tmp_path_factory.mktemp("loading")
    odd = dict(vocab_size=67, intermediate_size=66)  # 67 rows: 34 + 33, 17 x 3 + 16
    tiny_model_dir(work / "odd", **odd)
    tiny_model_dir(work / "tied16", dtype=torch.bfloat16, tie_word_embeddings=True, **odd)
    tiny_model_dir(work / "mixtral", family="mixtral", num_local_experts=2,
                   num_experts_per_tok=1)
    return work


@pytest.mark.parametrize("pool_name", ["dist1", "dist2", "dist4"])
@pytest.mark.parametrize("model", ["odd", "tied16", "mixtral"])
def test_fsdp_loads_exactly(models, model, pool_name, request):
    pool = request.getfixturevalue(pool_name)
    assert pool.run(loaded_differences, str(models / model), "fsdp")[0] == []


@pytest.mark.parametrize("model", ["odd", "tied16", "mixtral"])
def test_deepspeed_loads_exactly(models, model, dist2):
    pytest.importorskip("deepspeed")
    assert dist2.run(loaded_differences, str(models / model), "deepspeed")[0] == []


def test_deepspeed_bf16_keeps_fp32_rotary_tables(models, dist2):
    """zero.Init casts every floating tensor made inside it to bf16, the rotary inv_freq
    too; the buffers come from a build outside it. A bf16 checkpoint makes the bf16
    partitions (and so the fp32 master weights) exact as well."""
    pytest.importorskip("deepspeed")
    assert dist2.run(loaded_differences, str(models / "tied16"), "deepspeed", "bf16")[0] == []


@pytest.fixture(scope="module")
def memory_pool(monkeypatch_module):
    # Fresh ranks (the shared pools carry earlier tests' heaps), started with the variable
    # that makes glibc serve large blocks from mmap and return them on free.
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    pool = DistPool(2, timeout_s=600)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    work = tmp_path_factory.mktemp("big")
    tiny_model_dir(work / "big", dtype=torch.bfloat16, **BIG)
    tiny_model_dir(work / "small")
    return work


@pytest.mark.slow
def test_fsdp_rank_memory_is_half_the_model(memory_pool, big_models):
    for r in memory_pool.run(setup_memory, str(big_models / "big"), str(big_models / "small"),
                             "fsdp"):
        held, peak = r["after"] - r["before"], r["peak"] - r["before"]
        print(f"fsdp: M {M_MB:.0f} MB, after setup +{held:.1f} MB, peak +{peak:.1f} MB")
        assert 0.4 * M_MB <= held <= 0.5 * M_MB + 16, r
        assert peak <= 0.5 * M_MB + L_MB + 16, r


@pytest.mark.slow
def test_deepspeed_rank_memory_is_half_the_model(memory_pool, big_models):
    pytest.importorskip("deepspeed")
    for r in memory_pool.run(setup_memory, str(big_models / "big"), str(big_models / "small"),
                             "deepspeed"):
        held, peak = r["loaded"] - r["before"], r["loaded_peak"] - r["before"]
        print(f"deepspeed: M {M_MB:.0f} MB, loaded +{held:.1f} MB, peak while loading "
              f"+{peak:.1f} MB")
        assert 0.4 * M_MB <= held <= 0.5 * M_MB + 16, r
        assert peak <= 0.5 * M_MB + 2 * L_MB + 48, r
