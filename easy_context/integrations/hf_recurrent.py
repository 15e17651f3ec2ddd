"""A hybrid model's recurrent layers routed to easy_context.recurrent (transformers internals).

transformers 5.x lists, on each recurrent layer class, the kernel functions its forward calls
(``use_kernelized_func``): every layer instance holds its own wrapper of each,
``layer._kernel_funcs[name]``, and while the layer runs, the module-level function dispatches
to that wrapper (the hook ``kernels.kernelize`` uses to put hub kernels in). Routing a layer
gives those wrappers of *that layer* a forward that runs the distributed version with the
layer's settings (group, method's layout, ring degree; parallel/settings.py) and the call's
``document_ids``, around the kernel the wrapper would have run (transformers' torch path on
the CPU; flash-linear-attention / causal-conv1d where transformers picks them).

Every kernel function such a layer lists is either routed or made to raise, so no kernel ever
runs on a shard as if it were the whole sequence. A layer class is routed only when its kernel
functions are exactly a known set *and* it is one of the classes checked against one process
(``VERIFIED``): a forward can mix tokens outside its kernel functions, which no attribute
shows, so each new family is added with its test.

easy_context.generate passes its cache (``sharded_kv_cache``, as attention gets it) through
the layers to these functions: at the prefill they also keep each prompt's final recurrent
state and last convolution inputs in its transformers cache (generation/recurrent_state.py),
with the pad slots after each prompt made to leave the state unchanged; at each decode step
(one token, the same on every rank) they run transformers' own single-step path on that cache
(``causal_conv1d_forward`` with the cache, the single-step gated delta rule or KDA, Mamba-2's
``mamba2_scan_forward`` and Mamba-1's ``mamba_scan_forward`` with the cache), the single-step
kernels let through for that call only.
"""

from __future__ import annotations

from functools import partial
from types import MethodType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.generic_layer import CALL_STATE
from ..parallel import get_method
from ..parallel.settings import SequenceParallelSettings, module_settings, store_settings
from ..recurrent.conv import causal_conv1d
from ..recurrent.delta_rule import chunk_gated_delta_rule
from ..recurrent.mamba2 import mamba2_chunk_scan
from ..recurrent.selective_scan import selective_scan

Tensor = torch.Tensor
_ORIGINAL = "_easy_context_original_forward"
_DOCUMENTS = "_easy_context_document_ids"  # what the layer's caller got (_record_documents)
_RECORDED = "_easy_context_recorded_layers"  # on a caller: the layers it records ids for
_REPLAYS = "_easy_context_replays_documents"  # marks a checkpoint function wrapped to replay
# the keyword under which generate hands its sharded cache down to the kernels (hf.py's)
KV_CACHE_KWARG = "sharded_kv_cache"
_DECODING = "_easy_context_decoding"  # set on a layer while generate's decode step runs it
# generate's cache as the layer's caller got it (_record_documents: Jamba's passes none on)
_GENERATING = "_easy_context_generating"

# Gated DeltaNet (Qwen3-Next): the functions its forward calls, by the name transformers
# lists them under; the ones a training forward (no cache) never reaches raise.
# (the kernel names: fla's and causal-conv1d's, under which transformers' torch paths run)
GATED_DELTA_NET_FUNCS = frozenset({
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "causal_conv1d_forward", "causal_conv1d_fn", "causal_conv1d_update"})
# Mamba-2 (Granite 4 hybrids): the fused training kernel is made to decline (it returns None
# on transformers' torch path too), so the layer takes its unfused conv-then-scan path.
MAMBA2_FUNCS = frozenset({
    "causal_conv1d_forward", "causal_conv1d_fn", "causal_conv1d_update",
    "mamba_split_conv1d_scan_combined", "mamba2_scan_forward", "selective_state_update",
    "mamba_chunk_scan_combined"})
# Kimi Delta Attention (Kimi Linear): the gated delta rule with a per-channel gate g (B, S, H,
# d_k), the same call (chunk_kda / fused_recurrent_kda, fla's names), the same scan.
KDA_FUNCS = frozenset({
    "chunk_kda", "fused_recurrent_kda",
    "causal_conv1d_forward", "causal_conv1d_fn", "causal_conv1d_update"})
# Mamba-1 (Jamba): the conv, then mamba_scan_forward, which calls the selective scan
# (selective_scan_fn, mamba-ssm's name); the per-step update is a cached decode.
MAMBA1_FUNCS = frozenset({
    "causal_conv1d_forward", "causal_conv1d_fn", "causal_conv1d_update",
    "mamba_scan_forward", "selective_scan_fn", "selective_state_update"})
# Gated short convolutions (LFM2, LFM2-MoE, LFM3): B * x through the causal conv, times C;
# the conv is the only token mixing.
SHORT_CONV_FUNCS = frozenset({"causal_conv1d_forward", "causal_conv1d_fn", "causal_conv1d_update"})
# Layer classes whose whole forward was checked against one process
# (tests/dist/test_hf_recurrent.py): each mixes tokens only through its kernel functions.
VERIFIED = {"Qwen3NextGatedDeltaNet": GATED_DELTA_NET_FUNCS,
            # Qwen3.5 (dense and MoE): Qwen3-Next's layer with its projections split
            # (in_proj_qkv, _z, _b, _a), the same kernel calls
            "Qwen3_5GatedDeltaNet": GATED_DELTA_NET_FUNCS,
            "Qwen3_5MoeGatedDeltaNet": GATED_DELTA_NET_FUNCS,
            # OLMo hybrid: separate projections, a g_proj gate, beta scaled by 2; same kernels
            "OlmoHybridGatedDeltaNet": GATED_DELTA_NET_FUNCS,
            "GraniteMoeHybridMambaLayer": MAMBA2_FUNCS,
            # Granite's Mamba-2 layer, forward line for line (Bamba's and Nemotron-H's)
            "BambaMixer": MAMBA2_FUNCS, "NemotronHMamba2Mixer": MAMBA2_FUNCS,
            # the same with per-channel multipliers on its input and projection (Falcon-H1,
            # whose layers run it beside attention and add the two)
            "FalconH1Mixer": MAMBA2_FUNCS,
            # and Zamba2's, fed (in its "hybrid" layers) a shared attention block's output, per
            # token through a linear layer
            "Zamba2MambaMixer": MAMBA2_FUNCS,
            # Kimi Linear's KDA: q, k, v each through the conv, a per-channel forget gate
            "KimiLinearDeltaAttention": KDA_FUNCS,
            # Jamba's Mamba-1 (its decoder layer passes the mixer no kwargs: _record_documents)
            "JambaMambaMixer": MAMBA1_FUNCS,
            # one ShortConv, three families
            "Lfm2ShortConv": SHORT_CONV_FUNCS, "Lfm2MoeShortConv": SHORT_CONV_FUNCS,
            "Lfm3ShortConv": SHORT_CONV_FUNCS}

# What runs, in words (check_model_supported's and generate's refusals and the docs name
# it); every routed layer also keeps its prompt state for easy_context.generate.
RUNS = ("the gated DeltaNet of Qwen3-Next, Qwen3.5 (dense and MoE) and OLMo hybrid, the KDA of "
        "Kimi Linear, the gated short convolutions of LFM2, LFM2-MoE and LFM3, the Mamba-2 of "
        "Granite 4 hybrids, Bamba, Nemotron-H, Falcon-H1 and Zamba2, and the Mamba-1 of Jamba")


def _settings(layer: nn.Module) -> tuple[SequenceParallelSettings, str]:
    settings = module_settings(layer)
    return settings, get_method(settings.method).layout


def _refuse_cache(settings: SequenceParallelSettings):
    raise ValueError(f"{settings.method}: recurrent layers run sequence-parallel without a cache "
                     "(training, loss evaluation): pass use_cache=False, and generate with "
                     "easy_context.generate (which carries their state)")


def _documents(layer: nn.Module, document_ids: Tensor | None) -> Tensor | None:
    """The call's document_ids, or else those the layer's caller got (_record_documents)."""
    return document_ids if document_ids is not None else layer.__dict__.get(_DOCUMENTS)


def _generation(kwargs: dict, layer: nn.Module):
    """generate's cache, taken out of the kernel's keyword arguments, or else the one the
    layer's caller got (_record_documents); None: not generating."""
    gen = kwargs.pop(KV_CACHE_KWARG, None)
    return gen if gen is not None else layer.__dict__.get(_GENERATING)


class _Decoding:
    """Within: the layer's single-step kernels run (a decode step on the whole-prompt state)."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __enter__(self):
        self.layer.__dict__[_DECODING] = True

    def __exit__(self, *exc):
        self.layer.__dict__.pop(_DECODING, None)


def _prompt_slots(gen, like: Tensor) -> Tensor:
    """(B, S_local, 1, ...) (as many dims as ``like``, token-major) in ``like``'s dtype: 1 at
    this rank's prompt tokens, 0 at its pads."""
    valid = gen.recurrent.valid
    return valid.view(*valid.shape, *[1] * (like.dim() - 2)).to(like.dtype)


# the single-step rule transformers' layer runs at a decode step, by its chunked rule's name
_SINGLE_STEP = {"chunk_gated_delta_rule": "fused_recurrent_gated_delta_rule",
                "chunk_kda": "fused_recurrent_kda"}


def _delta_rule(name: str, layer: nn.Module, originals: dict[str, Callable]):
    kernel = originals[name]  # chunk_gated_delta_rule, or KDA's chunk_kda (a per-channel g)
    single_step = originals[_SINGLE_STEP[name]]

    def forward(query, key, value, g, beta, chunk_size: int | None = None, initial_state=None,
                output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                document_ids: Tensor | None = None, **kwargs):
        settings, layout = _settings(layer)
        document_ids = _documents(layer, document_ids)
        if initial_state is not None or output_final_state:
            _refuse_cache(settings)
        kwargs.pop("use_cache", None)
        gen = _generation(kwargs, layer)
        if gen is not None and gen.decoding:  # one token: transformers' single-step rule
            out, state = single_step(
                query, key, value, g=g, beta=beta,
                initial_state=gen.recurrent.state(layer.layer_idx), output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            gen.recurrent.keep_state(layer.layer_idx, state)
            return out, None
        if gen is not None:  # pads: no decay (log g = 0), no write (beta = 0): the state
            # passes them; g (B, S, H) or KDA's per channel (B, S, H, d_k), beta (B, S, H)
            g, beta = g * _prompt_slots(gen, g), beta * _prompt_slots(gen, beta)
        out, state = chunk_gated_delta_rule(
            query, key, value, g, beta, chunk_size, None, gen is not None,
            use_qk_l2norm_in_kernel, kernel=kernel, group=settings.group, layout=layout,
            ring_degree=settings.ring_degree, document_ids=document_ids, **kwargs)
        if gen is not None:
            gen.recurrent.keep_state(layer.layer_idx, state)
            state = None
        return out, state

    return forward


def _conv(layer: nn.Module, originals: dict[str, Callable]):
    kernel = originals["causal_conv1d_fn"]  # causal-conv1d's where transformers picks it

    def forward(conv1d: nn.Conv1d, hidden_states: Tensor, cache=None, layer_idx=None,
                activation: str | None = None, state_idx: int = 0,
                document_ids: Tensor | None = None, **kwargs):
        settings, layout = _settings(layer)
        document_ids = _documents(layer, document_ids)
        if cache is not None:
            _refuse_cache(settings)
        if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
            raise ValueError("sequence-parallel recurrent layers take packed documents as "
                             "document_ids (one id per token)")
        gen = _generation(kwargs, layer)
        index = layer_idx if layer_idx is not None else layer.layer_idx
        if gen is not None and gen.decoding:  # transformers' own cached step on the state
            gen.recurrent.conv_state(index, state_idx)  # never from a zero state
            with _Decoding(layer):
                return originals["causal_conv1d_forward"](
                    conv1d, hidden_states, gen.recurrent.cache, index, activation=activation,
                    state_idx=state_idx, **kwargs)
        if gen is not None:
            gen.recurrent.keep_conv_inputs(index, state_idx, hidden_states,
                                           conv1d.kernel_size[0])
        return causal_conv1d(hidden_states, conv1d.weight.squeeze(1), conv1d.bias, activation,
                             group=settings.group, layout=layout,
                             ring_degree=settings.ring_degree, document_ids=document_ids,
                             kernel=kernel)

    return forward


def _mamba2_scan(layer: nn.Module, originals: dict[str, Callable]):
    kernel = originals["mamba_chunk_scan_combined"]

    def forward(module: nn.Module, hidden_states: Tensor, B: Tensor, C: Tensor, dt: Tensor,
                cache=None, document_ids: Tensor | None = None, **kwargs):
        # hidden_states (B, S, H * P), B and C (B, S, G * N), dt (B, S, H)
        settings, layout = _settings(layer)
        document_ids = _documents(layer, document_ids)
        if cache is not None:
            _refuse_cache(settings)
        gen = _generation(kwargs, layer)
        if gen is not None and gen.decoding:  # transformers' own cached step on the state
            gen.recurrent.state(module.layer_idx)  # never from a zero state
            with _Decoding(layer):
                return originals["mamba2_scan_forward"](module, hidden_states, B, C, dt,
                                                        gen.recurrent.cache, **kwargs)
        b, length = hidden_states.shape[:2]
        dt_options = dict(dt_bias=module.dt_bias, dt_softplus=True,
                          dt_limit=module.time_step_limit)
        if gen is not None:
            # pads: a time step of 0 (no decay, no input), so the state passes them: the
            # kernel's own dt steps (bias, softplus, clamp) done here, then the pads zeroed
            limit = module.time_step_limit
            dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), limit[0], limit[1])
            dt = dt * _prompt_slots(gen, dt)
            dt_options = dict(dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")))
        y = mamba2_chunk_scan(
            hidden_states.view(b, length, module.num_heads, module.head_dim), dt,
            -torch.exp(module.A_log.float()),
            B.view(b, length, module.n_groups, module.ssm_state_size),
            C.view(b, length, module.n_groups, module.ssm_state_size), module.chunk_size,
            D=module.D, return_final_states=gen is not None, kernel=kernel,
            group=settings.group, layout=layout, ring_degree=settings.ring_degree,
            document_ids=document_ids, **dt_options)
        if gen is not None:
            y, state = y
            gen.recurrent.keep_state(module.layer_idx, state)
        return y.reshape(b, length, -1)

    return forward


def _selective_scan(layer: nn.Module, originals: dict[str, Callable]):
    kernel = originals["selective_scan_fn"]

    def forward(module: nn.Module, hidden_states: Tensor, time_step: Tensor, B: Tensor,
                C: Tensor, gate: Tensor, cache=None, document_ids: Tensor | None = None,
                **kwargs):
        # hidden_states, time_step (before dt_proj's bias), gate (B, D, S); B, C (B, S, N)
        settings, layout = _settings(layer)
        if cache is not None:
            _refuse_cache(settings)
        gen = _generation(kwargs, layer)
        if gen is not None and gen.decoding:  # transformers' own cached step on the state
            gen.recurrent.state(module.layer_idx)  # never from a zero state
            with _Decoding(layer):
                return originals["mamba_scan_forward"](module, hidden_states, time_step, B, C,
                                                       gate, gen.recurrent.cache, **kwargs)
        bias = module.dt_proj.bias
        delta_options = dict(delta_bias=None if bias is None else bias.float(),
                             delta_softplus=True)
        if gen is not None:
            # pads: a time step of 0 (decay 1, no input), so the state passes them: the
            # kernel's own steps (bias, softplus) done here, then the pads zeroed
            if bias is not None:
                time_step = time_step + bias.float().to(time_step.dtype)[:, None]
            time_step = F.softplus(time_step) * _prompt_slots(gen, time_step).transpose(1, 2)
            delta_options = dict(delta_bias=None, delta_softplus=False)
        # the layer's own call (transformers' mamba_scan_forward), on the shard
        out = selective_scan(
            hidden_states, time_step, -torch.exp(module.A_log.float()), B.transpose(1, 2),
            C.transpose(1, 2), D=module.D.float(), z=gate, return_last_state=gen is not None,
            kernel=kernel, group=settings.group, layout=layout,
            ring_degree=settings.ring_degree, document_ids=_documents(layer, document_ids),
            use_mambapy=module.use_mambapy, use_associative_scan=module.use_associative_scan,
            **delta_options)
        if gen is not None:
            out, state = out  # (B, D, S_local), (B, D, N)
            gen.recurrent.keep_state(module.layer_idx, state)
        return out

    return forward


def _decline(layer: nn.Module, originals: dict[str, Callable]):
    return lambda *args, **kwargs: None  # "no fused kernel here": the layer goes unfused


def _refuse(layer: nn.Module, name: str, original: Callable):
    def forward(*args, **kwargs):
        if layer.__dict__.get(_DECODING):  # generate's decode step: one token, whole state
            return original(*args, **kwargs)
        settings = module_settings(layer)
        raise ValueError(f"{settings.method}: {type(layer).__name__} called {name}, which does not "
                         "run sequence-parallel (a cached decoding step); run without a cache "
                         "(use_cache=False), or generate with easy_context.generate")

    return forward


# name -> (layer, every listed function's original forward by name) -> the routed forward
ROUTES: dict[str, Callable[[nn.Module, dict[str, Callable]], Callable]] = {
    "chunk_gated_delta_rule": partial(_delta_rule, "chunk_gated_delta_rule"),
    "chunk_kda": partial(_delta_rule, "chunk_kda"), "causal_conv1d_forward": _conv,
    "mamba2_scan_forward": _mamba2_scan, "mamba_scan_forward": _selective_scan,
    "mamba_split_conv1d_scan_combined": _decline}


def _kernel_funcs(module: nn.Module) -> dict[str, nn.Module]:
    funcs = module.__dict__.get("_kernel_funcs")
    return funcs if isinstance(funcs, dict) else {}


def stateful_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s layers that carry a recurrent or convolution state along the sequence
    (their kernel functions listed by transformers' ``use_kernelized_func``; attention
    modules' own, e.g. RoPE, mix no tokens): what a KV cache does not hold."""
    return [m for m in model.modules()
            if not hasattr(m, "is_causal") and isinstance(getattr(m, "layer_idx", None), int)
            and _kernel_funcs(m)]


def stateful_layers(model: nn.Module) -> list[str]:
    """The classes of :func:`stateful_modules`."""
    return sorted({type(m).__name__ for m in stateful_modules(model)})


def unroutable_stateful_layers(model: nn.Module) -> list[str]:
    """Of :func:`stateful_layers`, the classes this package does not route (whose state
    easy_context.generate therefore cannot carry)."""
    return sorted({type(m).__name__ for m in model.modules()
                   if not hasattr(m, "is_causal") and isinstance(getattr(m, "layer_idx", None), int)
                   and _kernel_funcs(m) and not routable(m)})


def unrouted_stateful_layers(model: nn.Module) -> list[str]:
    """Of the routable layers, the classes not routed now (no sequence-parallel settings
    stored on them: the model switched by its attention implementation alone)."""
    return sorted({type(m).__name__ for m in model.modules()
                   if routable(m) and module_settings(m) is None})


def routable(module: nn.Module) -> bool:
    """Whether ``module`` is a recurrent layer this package runs sequence-parallel."""
    expected = VERIFIED.get(type(module).__name__)
    return (expected is not None and set(_kernel_funcs(module)) == expected
            and not _forward_replaced(module))


def _forward_replaced(module: nn.Module) -> bool:
    # kernels' kernelize puts a hub layer's forward on the instance (classes that transformers
    # marks use_kernel_forward_from_hub, e.g. Qwen3.5's gated DeltaNet): that forward calls
    # none of the routed kernel functions, so it would run on a shard as if it were the whole
    # sequence. (accelerate's hooks also set one, around the forward they found)
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    if hasattr(module, "_hf_hook"):
        forward = module.__dict__.get("_old_forward", forward)
    return getattr(forward, "__func__", None) is not type(module).forward


def recurrent_layer_types(model: nn.Module, layer_types: list[str]) -> set[str]:
    """The layer types of ``layer_types`` whose every layer is routable (found by its
    ``layer_idx``): these do not stop the model from running sequence-parallel."""
    found: dict[int, bool] = {}
    for m in model.modules():
        index = getattr(m, "layer_idx", None)
        if hasattr(m, "is_causal"):
            continue  # an attention layer (its kernel functions, e.g. RoPE, mix no tokens)
        if isinstance(index, int) and _kernel_funcs(m):
            if type(m).__name__ in VERIFIED and _forward_replaced(m):
                raise ValueError(
                    f"{type(m).__name__} (layer {index}) has its forward replaced (a hub kernel "
                    "layer from kernels' kernelize / use_kernels=True), which does not run "
                    "sequence-parallel: load the model without use_kernels")
            found[index] = found.get(index, True) and routable(m)
    kinds = {}
    for i, t in enumerate(layer_types):
        kinds[str(t)] = kinds.get(str(t), True) and found.get(i, False)
    return {t for t, ok in kinds.items() if ok}


def _record_documents(caller: nn.Module, layer: nn.Module) -> None:
    """Some callers pass their recurrent layer none of the keyword arguments they got (Jamba's
    decoder layer: ``self.mamba(hidden_states=..., cache=..., attention_mask=...)``), so a
    model's ``document_ids`` would never reach the kernel functions and a packed batch would
    run as one document. A pre-hook on the caller records the ids it got (None when none:
    never a previous call's) on the layer, where the routed functions read them when their
    call brings none (_documents)."""
    layers = caller.__dict__.setdefault(_RECORDED, [])
    if any(m is layer for m in layers):
        return
    layers.append(layer)
    if len(layers) == 1:
        caller.register_forward_pre_hook(_record_hook, with_kwargs=True)
        caller.register_forward_hook(_forget_hook)
        # max-length mode's generic layers recompute the caller's forward themselves (not
        # through its checkpoint function): they take this to replay the recorded ids
        caller.__dict__[CALL_STATE] = _snapshot


def _record_hook(caller: nn.Module, args: tuple, kwargs: dict) -> None:
    for layer in caller.__dict__[_RECORDED]:
        layer.__dict__[_DOCUMENTS] = kwargs.get("document_ids")
        # generate's cache too (its decode and prefill state), for this call only (_forget_hook)
        layer.__dict__[_GENERATING] = kwargs.get(KV_CACHE_KWARG)
    # transformers' GradientCheckpointingLayer checkpoints its forward, not its __call__: the
    # recompute in backward runs without this hook, after later forwards may have recorded
    # other ids. The function it checkpoints is made to restore this forward's first.
    checkpoint = caller.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and not getattr(checkpoint, _REPLAYS, False):
        caller._gradient_checkpointing_func = _replaying(caller, checkpoint)


def _forget_hook(caller: nn.Module, args: tuple, output) -> None:
    """After the call: generate's cache (the prompts' KV and states) is not kept on the layers."""
    for layer in caller.__dict__[_RECORDED]:
        layer.__dict__.pop(_GENERATING, None)


def _snapshot(caller: nn.Module) -> Callable[[], None]:
    """What _record_hook recorded for ``caller``'s current call, as a function that records
    it again (before a recompute of the call, which runs without the hook)."""
    recorded = [(m, m.__dict__.get(_DOCUMENTS)) for m in caller.__dict__[_RECORDED]]

    def restore() -> None:
        for layer, ids in recorded:
            layer.__dict__[_DOCUMENTS] = ids

    return restore


def _replaying(caller: nn.Module, checkpoint: Callable) -> Callable:
    def checkpointed(function: Callable, *args, **kwargs):
        restore = _snapshot(caller)

        def replay(*a, **k):  # runs now and again at the recompute
            restore()
            return function(*a, **k)

        return checkpoint(replay, *args, **kwargs)

    setattr(checkpointed, _REPLAYS, True)
    return checkpointed


_GUARD = "_easy_context_route_guard"


def _stop_kernelizing(model: nn.Module) -> None:
    """Turn off transformers' hub kernels (``use_kernels``: from_pretrained sets it from
    transformers 5.25). A kernelized model is kernelized again at every ``model.train()`` /
    ``model.eval()`` that changes its kernels Mode, which gives every kernel function wrapper
    back its own forward: the routing below would be gone, and the recurrent layers would run
    on each shard as if it were the whole sequence (the Trainer's train() did exactly that: a
    loss 1e-3 off at 2 ranks, no error)."""
    for module in model.modules():
        if getattr(module, "use_kernels", False) and hasattr(module, "set_use_kernels"):
            module.set_use_kernels(False)  # no re-kernelizing; torch's forwards


def _check_routed(layer: nn.Module, args, kwargs):
    """Forward pre-hook of a routed layer: its kernel functions must still be routed (a
    kernelize after apply_sequence_parallel, e.g. set_use_kernels(True), replaces them)."""
    if module_settings(layer) is None:
        return None
    for name, wrapper in _kernel_funcs(layer).items():
        if not getattr(wrapper.__dict__.get("forward"), "_easy_context_routed", False):
            raise ValueError(f"{type(layer).__name__} (layer {layer.layer_idx}): its kernel "
                             f"function {name} was replaced after apply_sequence_parallel (a "
                             "kernelize: use_kernels / set_use_kernels(True)), so it would run "
                             "on each shard as if it were the whole sequence; call "
                             "easy_context.apply_sequence_parallel again after kernelizing, or "
                             "leave use_kernels off")
    return None


def _routed_forward(fn: Callable, wrapper: nn.Module):
    def forward(self, *args, **kwargs):
        return fn(*args, **kwargs)

    forward._easy_context_routed = True
    # bound, as kernelize sets it (the layer's dispatch reads forward.__func__)
    return MethodType(forward, wrapper)


def route_recurrent_layers(model: nn.Module, settings: SequenceParallelSettings) -> int:
    """Store ``settings`` on every routable layer and route its kernel functions (again:
    the new settings count). Returns the number of layers routed."""
    count = 0
    callers = {child: parent for parent in model.modules() for child in parent.children()}
    if any(routable(m) for m in model.modules()):
        _stop_kernelizing(model)
    for m in model.modules():
        if not routable(m):
            continue
        store_settings(m, settings)
        if m in callers:
            _record_documents(callers[m], m)
        originals = {}
        for name, wrapper in _kernel_funcs(m).items():
            if _ORIGINAL not in wrapper.__dict__:  # what it ran before (kernelize may have set it)
                wrapper.__dict__[_ORIGINAL] = (wrapper.__dict__.get("forward")
                                               or type(wrapper).forward.__get__(wrapper))
            originals[name] = wrapper.__dict__[_ORIGINAL]
        for name, wrapper in _kernel_funcs(m).items():
            route = ROUTES.get(name)
            wrapper.forward = _routed_forward(
                route(m, originals) if route else _refuse(m, name, originals[name]), wrapper)
        if getattr(m, _GUARD, None) is None:
            setattr(m, _GUARD, m.register_forward_pre_hook(_check_routed, with_kwargs=True))
        count += 1
    return count
