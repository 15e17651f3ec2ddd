"""Rank functions for max-length mode on hybrid models (recurrent and attention layers): the
generic path runs each recurrent layer's own forward, its mixer whole (routed to the
sequence-parallel kernels, the state exchanged between ranks) and its MLP tiled, against the
plain model in one process (float64, as hf_recurrent_cases: mild decays).

Returns {case: (loss relative error, worst gradient error relative to each parameter's max
|grad|, gradients summed over ranks)}.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.memory.maxlen import apply_max_length, decoder_layers, path_for

from .hf_cases import _grad_errors, make_batch
from .hf_recurrent_cases import _loss64, _packed_batch, _packed_reference, tiny_hybrid
from .maxlen_cases import step_counting_heads

def tiny(family: str, **config):
    """tiny_hybrid's model (its final norm under its own name: max-length mode finds it by
    what it is, maxlen.final_norm)."""
    return tiny_hybrid(family, **config)


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _max_length_loss(base, method: str, batch, case: tuple, ring_degree=None):
    """A copy of ``base``, sequence-parallel and in max-length mode (``case``: mlp_tile,
    heads_per_chunk, checkpointing, keep_every), and its chunked loss on this rank's shard of
    ``batch`` (inputs, positions, targets; packed documents when positions restart)."""
    rank, world = _world()
    inputs, positions, targets = batch[:3]
    tile, chunk, kind, keep_every = case
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method, ring_degree=ring_degree)
    apply_max_length(model, tile, chunk, kind, keep_every=keep_every)
    local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world,
                                           "cpu", ring_degree=ring_degree)
    loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                             local["local_target_ids"], chunked=True, chunk_size=5,
                             document_ids=local["local_document_ids"])
    return model, loss


def check_hybrid_max_length(family: str, method: str, cases: list[tuple],
                            ring_degree: int | None = None, packed: bool = False,
                            **config) -> dict:
    """{case: (loss error, grad error)} for each (mlp_tile, heads_per_chunk, checkpointing,
    keep_every) of ``cases``: one step of ``family``'s tiny model in max-length mode against the
    plain model in float64 in one process; ``packed``: four documents straddling the shards
    (the reference runs each alone)."""
    _, world = _world()
    base = tiny(family, **config)
    length = 2 * world * 6
    if packed:
        batch = _packed_batch(base, length, [0, 3, length // 2 + 1, length - 5])
        ref = copy.deepcopy(base).double()
        ref_loss = _packed_reference(ref, *batch)
    else:
        batch = make_batch(length, base.config.vocab_size)
        ref = copy.deepcopy(base).double()
        inputs, positions, targets = batch
        ref_loss = _loss64(ref, inputs, targets, positions) / (targets != -100).sum()
    ref_loss.backward()
    report = {}
    for case in cases:
        model, loss = _max_length_loss(base, method, batch, case, ring_degree)
        loss.backward()
        report[" ".join(map(str, case))] = (abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                                            _grad_errors(model, ref))
    return report


def check_documents_between_forwards(family: str, method: str, case: tuple) -> tuple:
    """Two packed batches forward in max-length mode, then one backward of the sum: each
    layer's recompute must see its own batch's document ids (Jamba's decoder layer hands its
    Mamba layer none: hf_recurrent records them from the layer's call, which the generic
    path's recompute does not go through). (loss error, grad error)."""
    _, world = _world()
    base = tiny(family)
    length = 2 * world * 5
    batches = [_packed_batch(base, length, [0, 3, length // 2 + 1, length - 5]),
               _packed_batch(base, length, [0, 7, length - 3], seed=4)]
    ref = copy.deepcopy(base).double()
    ref_loss = sum(_packed_reference(ref, *b) for b in batches)
    ref_loss.backward()
    rank = _world()[0]
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method)
    apply_max_length(model, *case[:3], keep_every=case[3])
    losses = []
    for inputs, positions, targets, _ in batches:
        local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world,
                                               "cpu")
        losses.append(ec.causal_lm_loss(model, local["local_input_ids"],
                                        local["local_position_ids"], local["local_target_ids"],
                                        chunked=True, chunk_size=5,
                                        document_ids=local["local_document_ids"]))
    loss = sum(losses)
    loss.backward()
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), _grad_errors(model, ref)


def hybrid_paths(family: str, **config) -> list[str]:
    """Each decoder layer's max-length path (maxlen.path_for) for this tiny hybrid."""
    model = tiny(family, **config)
    return [path_for(layer, model) for layer in decoder_layers(model)]


def hybrid_calls(family: str, tile: int, chunk: int) -> dict:
    """What max-length mode hands a hybrid's own modules in one forward and backward of one
    rank (24 tokens): the tokens of each MLP call and of each recurrent mixer call, the query
    heads of each attention call."""
    from easy_context.integrations.hf_recurrent import stateful_modules
    from easy_context.memory.generic_layer import find_mlps

    model = tiny(family)
    ec.apply_sequence_parallel(model, "local")
    seen = {"heads": [], "mlp tokens": [], "mixer tokens": []}

    def spy(module, key):
        def hook(m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            seen[key].append(x.size(1))
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    mlps = {id(m): m for layer in decoder_layers(model) for _, m in find_mlps(layer)}
    for mlp in mlps.values():  # once each: Zamba2's hybrid layers share one block's MLP
        @functools.wraps(mlp.forward)  # its signature: the probe reads it (Zamba2's layer_idx)
        def forward(x, *args, _forward=mlp.forward, **kwargs):  # an instance forward: the
            seen["mlp tokens"].append(x.size(1))  # tiles call it
            return _forward(x, *args, **kwargs)

        mlp.forward = forward
    for mixer in stateful_modules(model):
        spy(mixer, "mixer tokens")
    apply_max_length(model, tile, chunk, "full")
    seen["mlp tokens"].clear()  # the probe's (apply_max_length checks the MLP is per token)
    return step_counting_heads(model, seen)


def forced_fused_error(family: str) -> str:
    """The ValueError apply_max_length raises when the fused path is forced on a hybrid."""
    model = tiny(family)
    ec.apply_sequence_parallel(model, "local")
    try:
        apply_max_length(model, 4, 2, "full", path="fused")
    except ValueError as e:
        return str(e)
    return "no error"


def train_flags_turn_it_on(family: str) -> tuple[bool, bool]:
    """train's apply_memory_mode with --mlp-tile 4 --head-chunk 2 on this family: (whether it
    says max-length mode is on, whether the model is in it). Kimi Linear's KDA is a mixer the
    planner does not read: given numbers, nothing is planned."""
    import torch

    from easy_context.memory.maxlen import max_length_settings
    from easy_context.train.config import TrainConfig
    from easy_context.train.memory_mode import apply_memory_mode

    model = tiny(family)
    ec.apply_sequence_parallel(model, "local")
    train = TrainConfig(model=f"{family}-tiny", dataset="d", mlp_tile="4", head_chunk="2")
    on = apply_memory_mode(model, train, 1, torch.device("cpu"))
    return on, max_length_settings(model) is not None
