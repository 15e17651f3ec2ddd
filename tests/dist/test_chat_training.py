"""Chat data through the trainer's batches: a packed window whose labels mask everything but
the assistant turns, sharded over 2 ranks, gives the loss and gradients of one process that
runs each conversation (segment) of the window alone, counting only the assistant tokens.

Tolerance: loss and every parameter gradient (summed over ranks) within 1e-5 relative (to the
reference loss / that parameter's max |grad|), fp32.
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import easy_context as ec
from easy_context.data import PrepareConfig, prepare_data
from easy_context.train.data import TrainBatches
from tests.unit.data_fixtures import load_tok
from tests.unit.test_data_chat import TEMPLATE, conversations, tokenizer_with_template, write_messages

from .hf_cases import _grad_errors

SEQ = 192
TOL = 1e-5


def _model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attention_dropout=0.0)).float()


def packed_chat_equals_unpacked(data_dir: str, vocab: int, method: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = TrainBatches(datasets.load_from_disk(data_dir), SEQ, batch_size=1, dp=1,
                           dp_rank=0, seed=0)
    # the first window that packs several conversations and has assistant tokens in it
    batch = next(b for b in map(batches.get, range(len(batches.dataset)))
                 if (b["position_ids"] == 0).sum() >= 3 and (b["target_ids"] != -100).any())
    ids, pos, tgt = batch["input_ids"], batch["position_ids"], batch["target_ids"]
    assert (tgt != -100).sum() < (pos != 0).sum()  # the mask removes prompt tokens
    base = _model(vocab)
    # reference: each segment of the window alone, plain attention, token-weighted mean
    ref = copy.deepcopy(base)
    starts = (pos[0] == 0).nonzero().squeeze(1).tolist() + [SEQ]
    total, count = 0.0, 0
    for a, b in zip(starts, starts[1:]):
        logits = ref(input_ids=ids[:, a:b]).logits.float()[0]
        total = total + F.cross_entropy(logits, tgt[0, a:b], ignore_index=-100, reduction="sum")
        count += int((tgt[0, a:b] != -100).sum())
    ref_loss = total / count
    ref_loss.backward()
    # sequence-parallel: the trainer's batch, packed, sharded, documents kept apart
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method)
    local = ec.prepare_seq_parallel_inputs(method, ids, pos, tgt, rank, world, "cpu")
    loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                             local["local_target_ids"], document_ids=local["local_document_ids"])
    loss.backward()
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), _grad_errors(model, ref)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_train")
    write_messages(root / "chat.jsonl", conversations(12, seed=3))
    tok = tokenizer_with_template(root, TEMPLATE)
    prepare_data(PrepareConfig(inputs=[str(root / "chat.jsonl")], tokenizer=tok,
                               output=str(root / "packed"), seq_length=SEQ, chat=True,
                               shuffle=False))
    return str(root / "packed"), len(load_tok())


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_packed_masked_chat_on_2_ranks_equals_unpacked(dist2, chat_data, method):
    for rank, (loss_err, grad_err) in enumerate(dist2.run(packed_chat_equals_unpacked,
                                                          *chat_data, method)):
        assert loss_err <= TOL and grad_err <= TOL, (rank, loss_err, grad_err)
