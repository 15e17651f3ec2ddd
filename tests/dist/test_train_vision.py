"""``easy-context train`` on image conversations (prepare-data --processor) at 2 ranks.

One optimizer step over every window of the prepared data (gradient accumulation over them
all) against one process: the model's own forward on each conversation alone, with its
images as its processor gives them (not read from the packed data), and the assistant turn
as the targets. The logged loss and gradient norm (every parameter's, the vision tower's
included) equal the reference within 1e-5 (fp32). Images straddle the 2-rank shard edges.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from easy_context.cli import main
from tests.dist.vision_train_cases import vision_train_error, vision_train_run
from tests.vision_fixtures import IMAGE, SEQ_LENGTH, conversations, vision_workdir

TOL = 1e-5


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = vision_workdir(tmp_path_factory.mktemp("vision_train"))
    for family in ("qwen", "llava"):
        out = work["root"] / f"packed_{family}"
        assert main(["prepare-data", str(work["jsonl"]), "--processor", str(work[family]),
                     "--seq-length", str(SEQ_LENGTH), "--output-dir", str(out)]) == 0
        work[f"packed_{family}"] = out
    return work


def _reference(work, family: str) -> tuple[float, float]:
    """(loss, gradient norm) of every conversation, each alone through the model's own
    forward in this process: the token mean over the assistant turns."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(work[family]), dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(str(work[family]))
    total, count = 0.0, 0
    for record in conversations([f"img{i}.png" for i in range(3)]):
        text = processor.apply_chat_template(record["messages"], tokenize=False)
        images = [Image.open(work["root"] / "data" / n).convert("RGB") for n in record["images"]]
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        ids = inputs["input_ids"]
        # the assistant turn: after the last "assistant" word to the end (its <|im_end|>)
        first = int((ids[0] == 89).nonzero()[-1]) + 1
        targets = torch.full_like(ids, -100)
        targets[0, first - 1:-1] = ids[0, first:]
        kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        logits = model(input_ids=ids, **kwargs).logits
        total = total + F.cross_entropy(logits[0], targets[0], ignore_index=-100,
                                        reduction="sum")
        count += int((targets != -100).sum())
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                          if p.grad is not None))
    return loss.item(), norm.item()


@pytest.mark.parametrize("family,method", [("qwen", "ulysses_attn"),
                                           ("llava", "zigzag_ring_attn")])
def test_one_step_at_2_ranks_equals_one_process(dist2, work, family, method, tmp_path):
    data = work[f"packed_{family}"]
    windows = json.loads((data / "stats.json").read_text())["windows"]
    import datasets

    # some image sits across a 2-rank shard edge (zigzag: 16, 32, 48; contiguous: 32)
    edges = (16, 32, 48) if method.startswith("zigzag") else (32,)
    straddles = 0
    for row in datasets.load_from_disk(str(data)):
        image = torch.tensor(row["input_ids"][:SEQ_LENGTH]) == IMAGE
        straddles += sum(bool(image[e - 1] and image[e]) for e in edges)
    assert straddles > 0
    got = dist2.run(vision_train_run, str(work[family]), str(data), str(tmp_path / "run"),
                    parallel_mode=method, gradient_accumulate_every=windows, export=False)[0]
    want_loss, want_norm = _reference(work, family)
    assert math.isfinite(got[0]["loss"]) and math.isfinite(want_loss)
    assert abs(got[0]["loss"] - want_loss) <= TOL * abs(want_loss), (got[0], want_loss)
    assert abs(got[0]["grad_norm"] - want_norm) <= TOL * want_norm, (got[0], want_norm)


def test_refusals(dist2, work, tmp_path):
    """What the vision path does not take, refused in one line on every rank."""
    from tests.train_fixtures import tiny_model_dir

    text_model = tiny_model_dir(tmp_path / "text", vocab_size=97)
    cases = [(dict(model=str(text_model)), "has no vision tower"),
             (dict(engine="deepspeed"), "--engine deepspeed does not take vision-language"),
             (dict(lora_rank=4), "--lora-rank does not take vision-language"),
             (dict(seq_length=32), "train with --seq-length 64")]
    for overrides, fragment in cases:
        values = dict(model=str(work["qwen"]), dataset=str(work["packed_qwen"]),
                      output=str(tmp_path / "bad"))
        values.update(overrides)
        for error in dist2.run(vision_train_error, values.pop("model"), values.pop("dataset"),
                               values.pop("output"), **values):
            assert fragment in error, error
    shutil.rmtree(tmp_path / "bad", ignore_errors=True)


def _text_reference(model_dir, data_dir) -> tuple[float, float]:
    """(loss, gradient norm) of every packed text document of every window, each alone
    through the vision-language model's own forward: the next token inside each document."""
    import datasets
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    total, count = 0.0, 0
    for row in datasets.load_from_disk(str(data_dir)):
        ids, positions = torch.tensor(row["input_ids"]), torch.tensor(row["position_ids"])
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            if b - a < 2:
                continue
            logits = model(input_ids=ids[None, a:b]).logits[0]
            total = total + F.cross_entropy(logits[:-1], ids[a + 1:b], reduction="sum")
            count += b - a - 1
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                          if p.grad is not None))
    return loss.item(), norm.item()


def test_text_data_on_a_vision_model_at_2_ranks_equals_one_process(dist2, work, tmp_path):
    """Packed text (no pixel columns) trains a vision-language model through the same path:
    positions from the model's get_rope_index per document, the tower given zero gradients."""
    from tests.train_fixtures import tiny_dataset_dir

    data = tiny_dataset_dir(tmp_path / "text", SEQ_LENGTH, rows=2, vocab=64, packed=True)
    got = dist2.run(vision_train_run, str(work["qwen"]), str(data), str(tmp_path / "run"),
                    parallel_mode="zigzag_ring_attn", gradient_accumulate_every=2,
                    export=False)[0]
    want_loss, want_norm = _text_reference(work["qwen"], data)
    assert math.isfinite(got[0]["loss"]) and math.isfinite(want_loss)
    assert abs(got[0]["loss"] - want_loss) <= TOL * abs(want_loss), (got[0], want_loss)
    assert abs(got[0]["grad_norm"] - want_norm) <= TOL * want_norm, (got[0], want_norm)


def test_refusals_on_the_command_line(work, tmp_path, capsys):
    """The launcher's checks say the same in one line, before any rank starts."""
    from tests.train_fixtures import tiny_model_dir

    text_model = tiny_model_dir(tmp_path / "text", vocab_size=97)
    base = ["train", "--dataset", str(work["packed_qwen"]), "--output-dir", str(tmp_path / "o"),
            "--nproc-per-node", "2"]
    cases = [(["--model", str(text_model), "--seq-length", "64"], "has no vision tower"),
             (["--model", str(work["qwen"]), "--seq-length", "64", "--lora-rank", "4"],
              "--lora-rank does not take vision-language models"),
             (["--model", str(work["qwen"]), "--seq-length", "32"], "train with --seq-length 64")]
    for extra, fragment in cases:
        code = main(base + extra)
        err = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith("easy-context")]
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("easy-context train: error: ") and fragment in err[0], err[0]


def test_preflight_refuses_before_any_rank_starts(work, tmp_path):
    from easy_context.train.config import TrainConfig
    from easy_context.train.preflight import preflight
    from tests.train_fixtures import tiny_model_dir

    text_model = tiny_model_dir(tmp_path / "text", vocab_size=97)
    for model, extra, fragment in [(text_model, {}, "has no vision tower"),
                                   (work["qwen"], {"engine": "deepspeed"},
                                    "--engine deepspeed does not take")]:
        config = TrainConfig(model=str(model), dataset=str(work["packed_qwen"]), seq_length=64,
                             output_dir=str(tmp_path / "o"), nproc_per_node=2, **extra)
        config.validate()
        with pytest.raises(ValueError, match=fragment):
            preflight(config)


def test_resumed_run_equals_an_uninterrupted_one(dist2, work, tmp_path):
    """Checkpoints hold the vision tower (in FSDP's root unit) and the data position: a run
    stopped after step 2 and resumed gives step 3's loss bit for bit."""
    args = (str(work["qwen"]), str(work["packed_qwen"]))
    whole = dist2.run(vision_train_run, *args, str(tmp_path / "whole"), max_train_steps=3,
                      export=False)[0]
    dist2.run(vision_train_run, *args, str(tmp_path / "cut"), max_train_steps=2, save_every=1,
              export=False)
    resumed = dist2.run(vision_train_run, *args, str(tmp_path / "cut"), max_train_steps=3,
                        resume=True, export=False)[0]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]
    assert len(whole) == 3


def test_a_rank_share_lies_on_its_device(work):
    """shard_vision_batch puts every tensor the loss reads on the rank's device, the vision
    shard's too (a GPU's NCCL and kernels take no host tensors): checked with the meta
    device standing in for a GPU. The batch holds the windows' images in row order."""
    import dataclasses

    import datasets
    from transformers import AutoModelForImageTextToText

    from easy_context.train.data import TrainBatches
    from easy_context.train.vision import shard_vision_batch

    model = AutoModelForImageTextToText.from_pretrained(str(work["qwen"]), dtype=torch.float32)
    ds = datasets.load_from_disk(str(work["packed_qwen"]))
    batches = TrainBatches(ds, SEQ_LENGTH, batch_size=2, dp=1, dp_rank=0, seed=0)
    batch = batches.get(0)
    rows = [ds[i] for i in batches._indices(0)]
    want = torch.cat([torch.tensor(r["pixel_values"]).view(r["pixel_values_shape"])
                      for r in rows if r["pixel_values_shape"][0]])
    assert torch.equal(batch["pixel_values"], want)
    local = shard_vision_batch(model, batch, "zigzag_ring_attn", 1, 2, None,
                               torch.device("meta"))
    tensors = [v for k, v in local.items() if k != "vision"]
    for media in local["vision"].media:
        tensors += [v for v in dataclasses.astuple(media) if isinstance(v, torch.Tensor)]
    assert len(tensors) > 5 and all(t.device.type == "meta" for t in tensors)


@pytest.mark.parametrize("family,method", [("qwen", "zigzag_ring_attn"),
                                           ("llava", "ulysses_attn")])
def test_max_length_mode_with_images_equals_one_process(dist2, work, family, method, tmp_path):
    """--mlp-tile 5 --head-chunk 2 (max-length mode: the decoder's layers tiled and
    head-chunked, the final norm in the loss's chunks) on the image conversations: the same
    step as the reference (vision.vision_language_loss runs the tiled decoder)."""
    data = work[f"packed_{family}"]
    windows = json.loads((data / "stats.json").read_text())["windows"]
    got = dist2.run(vision_train_run, str(work[family]), str(data), str(tmp_path / "run"),
                    parallel_mode=method, gradient_accumulate_every=windows, export=False,
                    mlp_tile="5", head_chunk="2")[0]
    want_loss, want_norm = _reference(work, family)
    assert math.isfinite(got[0]["loss"]) and math.isfinite(want_loss)
    assert abs(got[0]["loss"] - want_loss) <= TOL * abs(want_loss), (got[0], want_loss)
    assert abs(got[0]["grad_norm"] - want_norm) <= TOL * want_norm, (got[0], want_norm)
