"""Every causal-LM family transformers registers, built tiny, against one process.

For each family in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING`` (config class -> model
class): the model is built from its config class with small sizes (hidden 32, 2 layers,
vocab 97; a few families need their own fields, FAMILY_FIELDS), then one training step
(fp32, forward + backward, the global token-mean loss with uneven ignored targets) runs at
2 gloo ranks for each method, against the same step in one process. Each family gets, for
plain sequence parallelism, max-length mode and easy_context.generate, one of:

- ``exact``: loss and every gradient within 1e-5 relative, or within 3x the family's own
  fp32 rounding (its one-process fp32 step against fp64: Gemma 4's is 2e-5) where that is
  larger (greedy tokens equal, for generation);
- ``refused``: easy_context raised a ValueError before running (its message is recorded);
- ``DIFFERS``: it ran and gave other numbers, no error raised (a defect: the promise is
  exact or refused);
- ``error``: easy_context failed with another exception (a defect: no refusal);
- ``not a decoder LM``: in one process, a position's logits depend on later tokens;
- ``could not build tiny`` / ``could not run tiny``: the sweep could not make a small model of
  it, or that model fails in one process on input_ids alone (the reason; the sweep's sizes,
  not easy_context, are at fault, or the model needs other inputs).

    OMP_NUM_THREADS=1 python benchmarks/families.py               # all of them (~15 min)
    python benchmarks/families.py --families llama,bart --no-write
    python benchmarks/families.py --docs                          # the table from the JSON

Results: benchmarks/results/families.json (rows merged by family, so partial runs add up);
the support table docs/guides/families.md is generated from it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

# what the classification depends on: the integration and its refusals (hybrid layers'
# routing, whole-sequence hooks), the methods, the recurrent scans, the loss, max-length mode
# (its layer checks) and generation
MEASURES = ["easy_context/integrations", "easy_context/utils/decoder.py",
            "easy_context/parallel", "easy_context/attention", "easy_context/recurrent",
            "easy_context/sequence_parallel.py", "easy_context/layouts.py",
            "easy_context/memory", "easy_context/generation"]
METHODS = ("zigzag_ring_attn", "ulysses_attn")
TOL = 1e-5
GRAD_FLOOR = 1e-3
NOISE_FACTOR = 3.0
WORLD = 2
DOCS = common.REPO / "docs" / "guides" / "families.md"
MAX_PARAMS = 150_000_000  # beyond this the config ignored the small sizes (vision towers...)

# Sizes every family gets (a config keeps what it does not know as a plain attribute).
# is_decoder: BERT-style families are causal LMs only with it.
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=512, decoder_layers=2, encoder_layers=2,
             decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
             encoder_ffn_dim=64, d_model=32, num_local_experts=4, num_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             rotary_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=2, is_decoder=True)
# Fields some families need on top (checked against their config validators).
FAMILY_FIELDS: dict[str, dict] = {
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_expand=2),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_expand=2),
    "mamba2": dict(num_heads=4, head_dim=16, expand=2),
    "dots3_note": dict(num_key_value_heads=4),
    "dots3_note_text": dict(num_key_value_heads=4),
    "dots1": dict(n_shared_experts=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "zaya": dict(num_experts_per_tok=1),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    # 1.0: sparsemixer masks no expert, so training really samples (at 0.01 the tiny router's
    # mask leaves one expert per draw and the sampling picks it whatever the draw)
    "phimoe": dict(router_jitter_noise=1.0),
    "kolibri1_1": dict(head_dim=16),
    "gemma4_text": dict(vocab_size_per_layer_input=97, hidden_size_per_layer_input=8),
    "gemma4": dict(vocab_size_per_layer_input=97, hidden_size_per_layer_input=8),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    # one input, one recurrent (run twice per forward) and one output layer: its defaults
    # (8 input and 8 output layers) leave the 2-layer model running each layer twice in a row
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1),
    "gemma3n": dict(num_kv_shared_layers=0),
}
# Multi-head latent attention (DeepSeek-V2/V3 style): the RoPE part of a head is head_dim.
for _family in ("deepseek_v2", "deepseek_v3", "axk1", "axk2", "glm4_moe_lite", "longcat_flash",
                "youtu", "kimi_linear", "minicpm3", "sarvam_mla", "deepseek_v32", "glm_moe_dsa",
                "hy_v4", "mimo_v2_flash"):
    FAMILY_FIELDS.setdefault(_family, {}).update(
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        head_dim=4, num_key_value_heads=4)
# Scalars that differ from their defaults, so that a dropped or inverted one shows: logit
# scaling (Granite divides, HyperCLOVAX multiplies), Gemma's query scale apart from head_dim,
# attention and final soft-capping that bite (with the larger q/k weights below).
for _family in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
                "hyperclovax", "minicpm3"):
    FAMILY_FIELDS.setdefault(_family, {})["logits_scaling"] = 2.5
for _family in ("gemma2", "gemma3_text", "gemma3", "vaultgemma"):
    FAMILY_FIELDS.setdefault(_family, {}).update(query_pre_attn_scalar=5,
                                                  attn_logit_softcapping=2.0,
                                                  final_logit_softcapping=3.0)
QK_INIT_SCALE = 4.0  # q and k projections x4: attention logits well away from 0
# Keys a family refuses to take (a read-only property, or a field it does not allow).
FAMILY_DROP: dict[str, tuple[str, ...]] = {
    "falcon": ("head_dim",),
    "xlnet": ("max_position_embeddings",),
    "prophetnet": ("num_hidden_layers", "encoder_layers", "decoder_layers"),
}
FAMILY_FIELDS["prophetnet"] = dict(num_encoder_layers=2, num_decoder_layers=2)


# ------------------------------------------------------------------------------ building
def families() -> dict[str, str]:
    """{model_type: causal-LM class name} for every registered family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: (v if isinstance(v, str) else v[0])
            for k, v in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())}


def _zero_dropouts(config) -> None:
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for k, v in list(vars(c).items()):
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
                setattr(c, k, 0.0)


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = {**SIZES, **FAMILY_FIELDS.get(model_type, {})}
    for key in FAMILY_DROP.get(model_type, ()):
        fields.pop(key, None)
    if "text_config" in (getattr(cls, "sub_configs", None) or {}):
        config = cls(text_config=fields)  # multimodal: the text model small, towers default
    else:
        config = cls(**fields)
    _zero_dropouts(config)
    return config


def build_tiny(model_type: str, seed: int = 0):
    """The family's causal LM, tiny, fp32, the same on every rank (seeded). Raises
    ValueError("could not build tiny: ...") when the config will not make a small model."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):  # count first: some configs ignore the sizes (GBs)
        meta = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters at the tiny sizes")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(k in name.split(".")[-2] for k in ("q_proj", "k_proj")):
                p.mul_(QK_INIT_SCALE)
    return model


# ------------------------------------------------------------------------------ one family
def _batch(length: int, vocab: int):
    """(2, length) ids, positions and shifted targets with uneven ignored (-100) spans."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, length + 1), generator=gen)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    targets[0, : length // 2 + 1] = -100
    targets[1, -3:] = -100
    return inputs, torch.arange(length).expand(2, -1), targets


def _reference(model, inputs, positions, targets):
    import torch.nn.functional as F

    torch.manual_seed(7)  # training-mode randomness (routers) as the sharded run draws it
    logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss


def grad_error(sp_model, ref_model, group=None) -> float:
    """The largest relative gradient error over parameters, gradients summed over ranks;
    NaN or inf when any gradient is not finite (never hidden by a max). Relative to the
    parameter's largest |gradient|, or to GRAD_FLOOR x the model's largest when that is
    more: some gradients are zero up to rounding (a key projection's bias cannot change a
    softmax), and their rounding is no error."""
    import torch.distributed as dist

    worst = torch.zeros((), dtype=torch.float64)
    largest = max((float(p.grad.abs().max()) for p in ref_model.parameters()
                   if p.grad is not None and p.grad.numel()), default=0.0)
    floor = max(GRAD_FLOOR * largest, 1e-12)
    for p_sp, p_ref in zip(sp_model.parameters(), ref_model.parameters()):
        if p_ref.grad is None and p_sp.grad is None:
            continue
        g = p_sp.grad.clone() if p_sp.grad is not None else torch.zeros_like(p_sp)
        if dist.is_initialized():
            dist.all_reduce(g, group=group)
        ref = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        err = ((g - ref).abs().max() / ref.abs().max().clamp(min=floor)).double()
        worst = torch.maximum(worst, err) if torch.isfinite(err) else err + worst * 0
        if not torch.isfinite(worst):
            break
    return float(worst)


def _causal(model, inputs) -> bool:
    """Whether a position's logits depend only on tokens up to it (one process)."""
    model = copy.deepcopy(model).eval()  # structure, not training-mode sampling
    with torch.no_grad():
        a = model(input_ids=inputs, use_cache=False).logits
        changed = inputs.clone()
        changed[:, -1] = (changed[:, -1] + 1) % model.config.get_text_config().vocab_size
        b = model(input_ids=changed, use_cache=False).logits
    return bool(torch.allclose(a[:, :-1], b[:, :-1], rtol=0, atol=1e-6))


def _outcome(fn) -> dict:
    """Run one sharded check: exact / DIFFERS from its errors, refused, or error."""
    try:
        return fn()
    except ValueError as e:
        return {"status": "refused", "reason": str(e).split("\n")[0]}
    except Exception as e:  # noqa: BLE001  (a raw error instead of a refusal is a finding)
        last = traceback.extract_tb(e.__traceback__)[-1]
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                                              f"({Path(last.filename).name}:{last.lineno})"}


def _judge(loss_err: float, grad_err: float, noise: tuple[float, float]) -> dict:
    """exact when within TOL, or within NOISE_FACTOR x the family's own fp32 rounding (its
    one-process fp32 step against fp64) where that is larger."""
    loss_tol, grad_tol = (max(TOL, NOISE_FACTOR * n) for n in noise)
    ok = loss_err <= loss_tol and grad_err <= grad_tol  # False for NaN
    return {"status": "exact" if ok else "DIFFERS", "loss_err": loss_err, "grad_err": grad_err}


def _fp32_noise(base, ref, ref_loss, inputs, positions, targets) -> tuple[float, float]:
    """(loss, gradient) error of the one-process fp32 step against the same step in fp64:
    how exact fp32 can be for this family at these sizes (Gemma 4's: 2e-5)."""
    try:
        ref64 = copy.deepcopy(base).double()
        if getattr(ref64, "_can_set_experts_implementation", lambda: False)():
            # MoE experts default to torch's grouped_mm, which takes no float64
            ref64.set_experts_implementation("eager")
        loss64 = _reference(ref64, inputs, positions, targets)
    except Exception:  # noqa: BLE001  (a family that cannot run in fp64: no allowance)
        return 0.0, 0.0
    loss_err = abs(ref_loss.item() - loss64.item()) / max(abs(loss64.item()), 1e-12)
    largest = max((float(p.grad.abs().max()) for p in ref64.parameters()
                   if p.grad is not None and p.grad.numel()), default=0.0)
    worst = 0.0  # one process: no sum over ranks (grad_error's collective) here
    for p32, p64 in zip(ref.parameters(), ref64.parameters()):
        if p32.grad is None or p64.grad is None:
            continue
        scale = max(float(p64.grad.abs().max()), GRAD_FLOOR * largest, 1e-12)
        worst = max(worst, float((p32.grad.double() - p64.grad).abs().max()) / scale)
    return loss_err, worst


def _sp_step(base, ref_loss, ref, method, inputs, positions, targets, chunked, max_length,
             noise=(0.0, 0.0)):
    import torch.distributed as dist

    import easy_context as ec

    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method)
    if max_length:
        from easy_context.memory.maxlen import apply_max_length, unsupported_reason

        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        apply_max_length(model, 4, 2, "full")
    local = ec.prepare_seq_parallel_inputs(method, inputs, positions, targets, rank, world, "cpu")
    torch.manual_seed(7)
    with _counting_tiled_layers() as runs, _counting_layer_calls(model, max_length) as calls:
        loss = ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                                 local["local_target_ids"], chunked=chunked)
    if max_length and len(runs) != len(calls):
        # a call the patched forward did not recognise ran as it was (layers may run more
        # than once per forward: HRM's stacks, Dory's recurrent section)
        return {"status": "error", "reason": f"{len(calls) - len(runs)} of {len(calls)} layer "
                                             "calls with grad ran untiled in max-length mode"}
    loss.backward()
    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
    return _judge(loss_err, grad_error(model, ref), noise)


@contextlib.contextmanager
def _counting_layer_calls(model, on: bool):
    """A list that gets one entry per call of a decoder layer with grad enabled (what
    max-length mode runs through its autograd functions), when ``on``."""
    calls: list = []
    handles = []
    if on:
        from easy_context.memory.maxlen import decoder_layers

        handles = [layer.register_forward_pre_hook(
            lambda *_: calls.append(1) if torch.is_grad_enabled() else None)
            for layer in decoder_layers(model)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _counting_tiled_layers():
    """A list that gets one entry per layer call that runs max-length mode's own forward
    (its fused or generic autograd function) inside."""
    from easy_context.memory import maxlen

    runs: list = []
    for cls in (maxlen.GenericLayer, maxlen.FusedLayer):
        def counted(*args, _apply=cls.apply):
            runs.append(1)
            return _apply(*args)

        cls.apply = counted
    try:
        yield runs
    finally:
        del maxlen.GenericLayer.apply, maxlen.FusedLayer.apply


def _greedy(model, prompt, steps: int) -> list[int]:
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.size(1):].tolist()


def _generation(base, method) -> dict:
    import easy_context as ec

    model = copy.deepcopy(base).eval()
    ref = copy.deepcopy(base).eval()
    prompt = _batch(12, base.config.get_text_config().vocab_size)[0][:1]
    want = _greedy(ref, prompt, 4)
    got = ec.generate(model, prompt, method=method, max_new_tokens=4, eos_token_id=[])
    tokens = got[0, prompt.size(1):].tolist()
    return {"status": "exact" if tokens == want else "DIFFERS",
            **({} if tokens == want else {"reason": f"tokens {tokens}, one process {want}"})}


def check_family(model_type: str, methods=METHODS, modes=("sp", "maxlen", "generate")) -> dict:
    """On every rank: this family's classification (see the module docstring)."""
    import easy_context as ec  # noqa: F401  (registers the attention functions)
    from easy_context.integrations.hf import output_head

    warnings.filterwarnings("ignore")
    row: dict = {"family": model_type, "class": families().get(model_type)}
    try:
        base = build_tiny(model_type)
    except Exception as e:  # noqa: BLE001
        row["status"] = "could not build tiny"
        row["reason"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return row
    row["class"] = type(base).__name__
    vocab = base.config.get_text_config().vocab_size
    inputs, positions, targets = _batch(2 * WORLD * 5, vocab)
    # refused up front (before the one-process checks: refused layer kinds may not even run)
    try:
        ec.check_model_supported(copy.deepcopy(base))
    except ValueError as e:
        row.update(status="refused", reason=str(e).split("\n")[0])
        return row
    except Exception as e:  # noqa: BLE001
        row.update(status="error", reason=f"{type(e).__name__}: {e}"[:300])
        return row
    try:
        causal = _causal(base, inputs)
        ref = copy.deepcopy(base)
        ref_loss = _reference(ref, inputs, positions, targets)
    except Exception as e:  # noqa: BLE001
        row.update(status="could not run tiny",
                   reason=f"one process fails on input_ids alone: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}"[:300])
        return row
    if not causal:
        row.update(status="not a decoder LM",
                   reason="in one process a position's logits depend on later tokens")
        return row
    linear_head = output_head(base)[0] is not None
    noise = _fp32_noise(base, ref, ref_loss, inputs, positions, targets)
    row["fp32_noise"] = {"loss": noise[0], "grad": noise[1]}
    results: dict = {}
    if "sp" in modes:
        for method in methods:
            for chunked in ((False, True) if linear_head else (False,)):
                results[f"{method} chunked={chunked}"] = _outcome(
                    lambda: _sp_step(base, ref_loss, ref, method, inputs, positions, targets,
                                     chunked, False, noise))
    sp_ok = all(r["status"] == "exact" for r in results.values())
    if "maxlen" in modes:  # the chunked loss (a BERT-style head's transform in its chunks)
        row["maxlen"] = _outcome(lambda: _sp_step(base, ref_loss, ref, methods[0], inputs,
                                                  positions, targets, True, True, noise))
    if "generate" in modes:
        row["generate"] = _outcome(lambda: _generation(base, methods[0]))
    row["sp"] = results
    statuses = {r["status"] for r in results.values()}
    row["status"] = ("exact" if sp_ok else "DIFFERS" if "DIFFERS" in statuses
                     else "error" if "error" in statuses else "refused")
    reasons = [r.get("reason") for r in results.values() if r.get("reason")]
    if reasons:
        row["reason"] = reasons[0]
    return row


# ------------------------------------------------------------------------------ the table
def _cell(entry: dict | None) -> str:
    if not entry:
        return ""
    status = entry["status"]
    return status if status in ("exact",) else f"{status}: {entry.get('reason', '')}".strip(": ")


def support_table(payload: dict) -> str:
    """The docs page, generated from the results file."""
    rows = payload["rows"]

    def count(statuses) -> str:
        counts: dict[str, int] = {}
        for status in statuses:
            counts[status] = counts.get(status, 0) + 1
        return ", ".join(f"{counts[k]} {k}" for k in sorted(counts))

    summary = (f"{count(r['status'] for r in rows)}; max-length mode: "
               f"{count(r['maxlen']['status'] for r in rows if r.get('maxlen'))}; generation: "
               f"{count(r['generate']['status'] for r in rows if r.get('generate'))}")
    lines = [
        "# Model families: what runs sequence-parallel",
        "",
        "<!-- generated by `python benchmarks/families.py --docs` from "
        "benchmarks/results/families.json; do not edit by hand -->",
        "",
        "Every causal-LM family that transformers "
        f"{payload.get('transformers', '')} registers (`MODEL_FOR_CAUSAL_LM_MAPPING`), built "
        "tiny from its config class (hidden 32, 2 layers), one fp32 training step at "
        f"{payload.get('world', WORLD)} ranks with {' and '.join(payload.get('methods', METHODS))} "
        "against the same step in one process. **exact**: loss and every gradient within "
        f"{payload.get('tol', TOL):g} relative, or within {NOISE_FACTOR:g}x the family's own "
        "fp32 rounding (its one-process fp32 step against fp64) where that is larger (for "
        "generation: the same greedy tokens). "
        "**refused**: easy_context raises a ValueError up front, saying why. "
        "**not a decoder LM**: in one process a position's logits depend on later tokens, or "
        "the model does not run on input_ids alone. **DIFFERS** or **error** would be defects "
        "(the promise is exact or refused).",
        "",
        f"{len(rows)} families: {summary}. Measured at commit "
        f"`{payload.get('machine', {}).get('git_commit')}`; reproduce with "
        "`OMP_NUM_THREADS=1 python benchmarks/families.py` (one family: `--families llama`).",
        "",
        "| family | causal-LM class | sequence parallel | max-length mode | generation |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        sp = r["status"] if r["status"] == "exact" else f"{r['status']}: {r.get('reason', '')}"
        sp = sp.replace("|", "\\|").strip(": ")
        # refused up front: every mode is (the reason is in the sequence-parallel column)
        other = "refused (as left)" if r["status"] == "refused" else ""
        cells = [r["family"], f"`{r.get('class') or ''}`", sp,
                 _cell(r.get("maxlen")).replace("|", "\\|") or other,
                 _cell(r.get("generate")).replace("|", "\\|") or other]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_docs(payload: dict) -> Path:
    DOCS.write_text(support_table(payload))
    return DOCS


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="", help="comma-separated model types (default: all)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per family")
    p.add_argument("--output", default="families")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--docs", action="store_true", help="regenerate the docs table and stop")
    args = p.parse_args(argv)
    if args.docs:
        print(f"wrote {write_docs(common.load_results(args.output))}")
        return 0
    import transformers

    from easy_context.testing import DistError, DistPool

    names = [f for f in args.families.split(",") if f] or list(families())
    methods = tuple(m for m in args.methods.split(",") if m)
    t_start = time.time()
    rows = []
    pool = DistPool(WORLD, threads_per_rank=1, timeout_s=args.timeout)
    try:
        for name in names:
            t0 = time.time()
            try:
                row = pool.run(check_family, name, methods, timeout_s=args.timeout)[0]
            except DistError as e:  # a hang (one rank raised inside a collective) or a crash
                row = {"family": name, "class": families().get(name), "status": "error",
                       "reason": str(e).strip().splitlines()[0][:300]}
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(f"[{time.time() - t_start:5.0f}s] {name}: {row['status']} "
                  f"{row.get('reason', '')[:150]}", file=sys.stderr, flush=True)
            if not args.no_write:  # after every family: a long sweep keeps what finished
                old = (common.load_results(args.output) or {}).get("rows", [])
                merged = sorted(common.merge_rows(old, rows, key=lambda r: r["family"]),
                                key=lambda r: r["family"])
                payload = {"benchmark": "families", "description": __doc__.split("\n\n")[1],
                           "machine": common.machine_info(), "argv": sys.argv[1:] if argv is None else argv,
                           "transformers": transformers.__version__, "world": WORLD,
                           "methods": list(methods), "tol": TOL, "rows": merged}
                common.write_results(args.output, payload)
                write_docs(payload)
    finally:
        pool.close()
    bad = [r["family"] for r in rows if r["status"] in ("DIFFERS", "error")
           or any((r.get(k) or {}).get("status") in ("DIFFERS", "error")
                  for k in ("maxlen", "generate"))]
    print(f"{len(rows)} families in {time.time() - t_start:.0f} s; DIFFERS or error: {bad or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
