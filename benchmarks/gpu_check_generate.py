"""gpu_check, part 5: sequence-parallel generation on the device (one rank).

Tokens: tiny models in fp32 (llama; gemma2 with soft-capping and a sliding window; gpt_oss
with sinks and a window), two left-padded prompts, greedy: easy_context.generate through
every method against transformers' own greedy ``generate`` on the same model. Reported per
method: whether the new tokens are equal and, where not, the first step that differs (fp32
kernels differ in the last bits; a near-tie may flip a token on a device even where the CPU
tests agree, so this is a finding to read, not a pass/fail).

Speed and memory: a Llama-3-8B-shaped model (2 layers, bf16) with a long prompt, 16 new
tokens: easy_context.generate (zigzag_ring_attn, one rank) against transformers' generate,
prefill and per-token decode time and the peak memory above the weights, and how many of the
new tokens agree (bf16: a flip is possible).
"""

from __future__ import annotations

import copy
import time

import torch

from benchmarks.gpu_check_train import _reset, _sync, llama3_8b_config

TWO_KINDS = ["sliding_attention", "full_attention"]
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, attention_dropout=0.0)
FAMILIES = {
    "llama": {},
    "gemma2": dict(sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   query_pre_attn_scalar=16, layer_types=TWO_KINDS),
    "gpt_oss": dict(sliding_window=5, layer_types=TWO_KINDS, num_local_experts=4,
                    num_experts_per_tok=2),
}
NEW_TOKENS = 12


def _tiny(family: str, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    config._attn_implementation = "eager"  # the family's own attention as the reference
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).eval()


def _prompts(vocab: int, lengths: tuple[int, ...], device):
    g = torch.Generator().manual_seed(5)
    longest = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), longest), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, longest - n:] = 1
        ids[row, :longest - n] = 0
    return ids.to(device), mask.to(device)


def _first_difference(a: list, b: list) -> int | None:
    steps = [i for i in range(len(a[0])) if any(x[i] != y[i] for x, y in zip(a, b))]
    return steps[0] if steps else None


def tokens(device) -> dict:
    import easy_context as ec

    out = {}
    for family in FAMILIES:
        try:
            base = _tiny(family, device)
            ids, mask = _prompts(base.config.vocab_size, (37, 20), device)
            want = copy.deepcopy(base).generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0)[:, ids.size(1):].tolist()
        except Exception as e:  # noqa: BLE001 - recorded
            out[family] = {"failed": f"reference: {type(e).__name__}: {e}"[:500]}
            continue
        rows = {}
        for method in sorted(ec.METHODS):
            try:
                got = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                                  ring_degree=1 if method == "usp_attn" else None,
                                  max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                  pad_token_id=0)[:, ids.size(1):].tolist()
                rows[method] = {"equal": got == want, "first_difference": _first_difference(got, want)}
            except Exception as e:  # noqa: BLE001 - recorded
                rows[method] = {"failed": f"{type(e).__name__}: {e}"[:500]}
        out[family] = rows
    return out


def _peak_above(device, start: int) -> int | None:
    return torch.cuda.max_memory_allocated(device) - start if device.type == "cuda" else None


def speed(device, tiny: bool, new_tokens: int = 16) -> dict:
    import easy_context as ec
    from transformers import AutoModelForCausalLM

    length = 256 if tiny else 32768
    config = llama3_8b_config(2, tiny)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    ids = torch.randint(3, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    row = {"L": length, "new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch.")}
    try:
        _reset(device)
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        want = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        _sync(device)
        row["transformers"] = {"total_s": round(time.perf_counter() - t0, 3),
                               "peak_above_weights_bytes": _peak_above(device, start)}
    except Exception as e:  # noqa: BLE001 - an OOM is a finding
        row["transformers"] = {"failed": f"{type(e).__name__}: {e}"[:500]}
        want = None
    try:
        _reset(device)
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        res = ec.generate(model, ids, method="zigzag_ring_attn", max_new_tokens=new_tokens,
                          eos_token_id=[], return_stats=True)
        _sync(device)
        row["easy_context"] = {
            "total_s": round(time.perf_counter() - t0, 3),
            "prefill_s": round(res.prefill_seconds, 3),
            "decode_s_per_token": round(res.decode_seconds / max(1, res.new_tokens - 1), 5),
            "cache_bytes": res.cache_bytes,
            "peak_above_weights_bytes": _peak_above(device, start)}
        if want is not None:
            a, b = want[0, length:].tolist(), res.sequences[0, length:].tolist()
            row["tokens_agree"] = sum(x == y for x, y in zip(a, b))
            row["first_difference"] = _first_difference([a], [b])
    except Exception as e:  # noqa: BLE001 - recorded
        row["easy_context"] = {"failed": f"{type(e).__name__}: {e}"[:500]}
    del model
    _reset(device)
    return row


def run(device, tiny: bool, log) -> dict:
    sec = {"tokens": tokens(device)}
    log("generate: tokens done")
    sec["speed"] = speed(device, tiny)
    log("generate: speed done")
    return sec
