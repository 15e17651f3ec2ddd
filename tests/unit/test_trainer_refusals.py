"""The Trainer integration's up-front checks that need no process group: which Trainer
classes' methods the mixin may replace, and which batch keys it passes on."""

import pytest
import torch

from easy_context.integrations.trainer import SequenceParallelMixin, _refuse_overrides
from easy_context.integrations.trainer_batches import check_batch_keys, shard_trainer_batch


def test_only_trainer_and_sft_trainer_methods_are_replaced():
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    for cls in (transformers.Trainer, trl.SFTTrainer):
        _refuse_overrides(cls)
        _refuse_overrides(type("Script", (SequenceParallelMixin, cls), {}))
    # a library subclass with its own prediction_step (generation) is not reproduced
    with pytest.raises(ValueError, match="Seq2SeqTrainer.prediction_step overrides"):
        _refuse_overrides(transformers.Seq2SeqTrainer)
    # a script's method placed before the mixin would shadow it
    shadow = type("Script", (SequenceParallelMixin, transformers.Trainer),
                  {"compute_loss": lambda self, *a, **k: None})
    with pytest.raises(ValueError, match="Script.compute_loss overrides"):
        _refuse_overrides(shadow)


def test_batch_keys_that_are_not_sharded_are_refused():
    ids = torch.arange(8).reshape(1, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    packed = {"input_ids": ids, "labels": ids, "position_ids": positions,
              "cu_seq_lens_q": torch.tensor([0, 3, 8]), "max_length_q": 5,
              "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])}
    check_batch_keys(packed)  # the documents' other views, recomputed from the positions
    no_positions = {k: v for k, v in packed.items() if k != "position_ids"}
    with pytest.raises(ValueError, match="keep position_ids"):
        check_batch_keys(no_positions)
    with pytest.raises(ValueError, match=r"carries \['pixel_values', 'token_type_ids'\]"):
        shard_trainer_batch({"input_ids": ids, "labels": ids, "token_type_ids": 0 * ids,
                             "pixel_values": torch.zeros(1, 3, 4, 4)}, "zigzag_ring_attn", 0, 2)
