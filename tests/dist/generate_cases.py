"""Sequence-parallel generation against transformers' own generate in one process.

Run on each rank: the same seed builds the same tiny model and prompts everywhere; the
reference is transformers' greedy ``generate`` on the whole batch in this process (the
family's own attention, a DynamicCache, left padding with an attention mask); the
sequence-parallel run prefills each rank's shard and decodes with the cache split over the
ranks. Returns what the test compares: the token ids themselves.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import easy_context as ec

from .hf_cases import tiny_model

NEW_TOKENS = 23  # crosses several shards: the new tokens go to the ranks in turn


def prompts(vocab: int, lengths: tuple[int, ...], seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, max length) prompts of the given lengths and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), longest), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, longest - n:] = 1
        ids[row, :longest - n] = 0
    return ids, mask


def reference(model, ids, mask, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


# each step's logits against transformers' (fp32): max abs difference over the largest
# |logit| (relative: Cohere 2's logit_scale keeps its tiny model's logits below 0.04)
LOGITS_TOL = 1e-5


def compare_methods(family: str, methods: list[str], lengths: tuple[int, ...],
                    ring_degree: int | None = None) -> dict[str, tuple[list, list]]:
    """{method: (reference tokens, sequence-parallel tokens)} for the new tokens; and for
    each method, "<method> logits": (True, whether every step's (B, V) logits are within
    LOGITS_TOL of transformers', relative) -- the tokens alone are argmaxes whose top two logits may be
    ~1e-2 apart, and a tiny model may repeat one token whatever the attention gives."""
    return compare_model(tiny_model(family).eval(), methods, lengths, ring_degree)


# A tiny Mamba-2's state reaches its output as x B C, cubic in in_proj's init (std 0.02): a
# decode from a zero state moved Granite's logits by 7e-6 (relative), under LOGITS_TOL. With
# in_proj 8x, 1.1e-3 (measured): a lost or wrong state fails the logits check.
MAMBA_IN_SCALE = 8.0


def compare_hybrid(family: str, methods: list[str], lengths: tuple[int, ...],
                   ring_degree: int | None = None) -> dict[str, tuple[list, list]]:
    """compare_methods for a tiny hybrid model (tests/dist/hf_recurrent_cases.py: gated
    DeltaNet, Mamba-2 or short-convolution layers beside attention)."""
    from .hf_recurrent_cases import tiny_hybrid, tiny_qwen3_next

    base = tiny_qwen3_next() if family == "qwen3_next" else tiny_hybrid(family)
    with torch.no_grad():
        for m in base.modules():
            if hasattr(m, "ssm_state_size") and hasattr(m, "in_proj"):  # a Mamba-2 or -1 mixer
                m.in_proj.weight.mul_(MAMBA_IN_SCALE)
    return compare_model(base.eval(), methods, lengths, ring_degree)


def compare_model(base, methods: list[str], lengths: tuple[int, ...],
                  ring_degree: int | None = None) -> dict[str, tuple[list, list]]:
    """compare_methods for the model ``base``."""
    ids, mask = prompts(base.config.vocab_size, lengths)
    out = copy.deepcopy(base).generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want, want_logits = out.sequences, torch.stack(out.logits, dim=1).float()  # (B, T, V)
    report = {}
    for method in methods:
        model = copy.deepcopy(base)
        rd = ring_degree if method == "usp_attn" else None
        got = ec.generate(model, ids, attention_mask=mask, method=method, ring_degree=rd,
                          max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0,
                          return_stats=True, output_logits=True)
        report[method] = (want[:, ids.size(1):].tolist(),
                          got.sequences[:, ids.size(1):].tolist())
        logits = torch.stack(got.logits, dim=1)  # (B, T, V)
        err = ((logits - want_logits).abs().max() / want_logits.abs().max()
               if logits.shape == want_logits.shape else None)
        report[f"{method} logits"] = (f"within {LOGITS_TOL}",
                                      f"within {LOGITS_TOL}" if err is not None
                                      and float(err) <= LOGITS_TOL else f"off by {err}")
    return report


def cache_shares(method: str, length: int, new_tokens: int) -> dict:
    """This rank's cache slots (filled, capacity) and bytes, against one process's."""
    base = tiny_model("llama").eval()
    ids, _ = prompts(base.config.vocab_size, (length,))
    result = ec.generate(copy.deepcopy(base), ids, method=method, max_new_tokens=new_tokens,
                         eos_token_id=[], return_stats=True)
    return {"bytes": result.cache_bytes, "steps": result.new_tokens,
            "tokens": result.sequences[0, length:].tolist()}


def sampled(method: str, seed: int, lengths: tuple[int, ...], **sampling) -> list:
    base = tiny_model("llama").eval()
    ids, mask = prompts(base.config.vocab_size, lengths)
    out = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                      max_new_tokens=NEW_TOKENS, do_sample=True, seed=seed, eos_token_id=[],
                      **sampling)
    return out[:, ids.size(1):].tolist()


def stops(method: str) -> dict:
    """EOS and a stop string end rows at different steps; the rest is padding."""
    base = tiny_model("llama").eval()
    ids, mask = prompts(base.config.vocab_size, (11, 6))
    free = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                       max_new_tokens=NEW_TOKENS, eos_token_id=[])[:, ids.size(1):]
    eos = int(free[0, 4])  # row 0's fifth token as EOS: row 0 stops there
    ended = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                        max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=1)
    return {"free": free.tolist(), "eos": eos, "ended": ended[:, ids.size(1):].tolist(),
            "rank": dist.get_rank()}


def adapted_model(four_bit: bool):
    """The tiny Llama as a peft PeftModel with LoRA adapters (B random, so they change the
    output), its decoder's linear layers optionally in NF4 (the 4-bit base of --lora-4bit)."""
    from peft import LoraConfig, get_peft_model

    from easy_context.train.qlora import NF4Linear, quantized_linears

    base = tiny_model("llama")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    if four_bit:
        for name, linear in quantized_linears(model).items():
            layer = NF4Linear(linear.in_features, linear.out_features, linear.bias)
            layer.quantize_(linear.weight.detach())
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, layer)
    return model.eval()


def compare_adapted(four_bit: bool, methods: list[str]) -> dict[str, tuple[list, list]]:
    base = adapted_model(four_bit)
    ids, mask = prompts(base.config.vocab_size, (13, 9))
    want = reference(copy.deepcopy(base), ids, mask)
    plain = reference(tiny_model("llama").eval(), ids, mask)
    report = {"adapters change the tokens": (True, want.tolist() != plain.tolist())}
    for method in methods:
        got = ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                          max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0)
        report[method] = (want[:, ids.size(1):].tolist(), got[:, ids.size(1):].tolist())
    return report


def _stopping_prompts(base, groups: int, new_tokens: int) -> tuple[list, int]:
    """One prompt per data-parallel group and an EOS that ends group 0's row at its third new
    token and never appears in the other groups' rows: the groups stop at different steps."""
    for seed in range(5, 200):
        rows = [prompts(base.config.vocab_size, (11 + g,), seed=seed + 7 * g) for g in range(groups)]
        free = [reference(base, ids, mask, new_tokens)[0, ids.size(1):].tolist()
                for ids, mask in rows]
        eos = free[0][2]
        if eos not in free[0][:2] and all(eos not in f for f in free[1:]):
            return rows, eos
    raise AssertionError("no prompts whose rows stop at different steps")


def data_parallel_groups_fsdp(sp: int = 2, method: str = "zigzag_ring_attn",
                              new_tokens: int = 10) -> dict:
    """Data-parallel groups of ``sp`` ranks on an FSDP2-sharded model (fully_shard on each
    decoder layer and on the model, over every rank, as transformers' Trainer and accelerate
    shard it), each group with a prompt that stops at another step: every group's tokens
    against transformers' greedy generate on that prompt in one process."""
    from torch.distributed.fsdp import fully_shard

    from easy_context.mesh import build_mesh
    from easy_context.train.engines.fsdp import decoder_layers

    mesh = build_mesh(sp)
    base = tiny_model("llama").eval()
    rows, eos = _stopping_prompts(base, mesh.dp, new_tokens)
    ids, mask = rows[mesh.dp_rank]
    want = base.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)[0, ids.size(1):].tolist()
    model = copy.deepcopy(base)
    ec.apply_sequence_parallel(model, method, group=mesh.sp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh.shard_mesh)
    fully_shard(model, mesh=mesh.shard_mesh)
    got = ec.generate(model, ids, attention_mask=mask, max_new_tokens=new_tokens,
                      eos_token_id=eos, pad_token_id=0)[0, ids.size(1):].tolist()
    return {"group": mesh.dp_rank, "want": want, "got": got, "eos": eos}


def mismatched_prompts() -> str:
    """Rank 1 of the group holds another prompt: the error every rank raises, or ''."""
    base = tiny_model("llama").eval()
    ids, mask = prompts(base.config.vocab_size, (9,))
    if dist.get_rank() == 1:
        ids = ids.clone()
        ids[0, -1] = (ids[0, -1] + 1) % base.config.vocab_size
    try:
        ec.generate(base, ids, attention_mask=mask, method="zigzag_ring_attn",
                    max_new_tokens=3, eos_token_id=[])
    except ValueError as e:
        return str(e)
    return ""


def mismatched_flags() -> str:
    base = tiny_model("llama").eval()
    ids, mask = prompts(base.config.vocab_size, (9,))
    try:
        ec.generate(base, ids, attention_mask=mask, method="zigzag_ring_attn",
                    max_new_tokens=3 + dist.get_rank(), eos_token_id=[])
    except ValueError as e:
        return str(e)
    return ""


def fresh_seeds(method: str) -> list:
    """Two sampled generations with no seed given: each call draws its own (on group rank 0),
    and every rank of the group samples the same tokens."""
    base = tiny_model("llama").eval()
    ids, mask = prompts(base.config.vocab_size, (13, 9))
    return [ec.generate(copy.deepcopy(base), ids, attention_mask=mask, method=method,
                        max_new_tokens=NEW_TOKENS, do_sample=True, eos_token_id=[])
            [:, ids.size(1):].tolist() for _ in range(2)]


def zero3_step_after_generate() -> dict:
    """DeepSpeed ZeRO-3 over both ranks (each its own data-parallel rank, the model switched
    to one-rank attention): generate, then one training step. Under torch.inference_mode the
    tensors ZeRO-3 puts in the parameters while it gathers and frees them for the generation's
    forwards are inference tensors (which autograd cannot save for backward); counted here."""
    import deepspeed

    from easy_context.train.engines.deepspeed import _start_deepspeed_comm

    _start_deepspeed_comm()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              # every parameter partitioned (tiny ones stay whole below the default
              # persistence threshold, and are never gathered)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_force_ds_cpu_optimizer": False,
              "bf16": {"enabled": False}}
    base = tiny_model("llama")
    # each rank its own prompt, rank 0's stopping (EOS) at its third token: the ranks are
    # data-parallel groups of one, and rank 1's forwards need rank 0's all-gathers
    rows, eos = _stopping_prompts(base.eval(), 2, 6)
    ids, mask = rows[dist.get_rank()]
    want = base.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)[0, ids.size(1):].tolist()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=base, optimizer=optimizer, config=config,
                                      dist_init_required=False)
    try:
        engine.module.eval()
        got = ec.generate(engine.module, ids, attention_mask=mask, method="local",
                          max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
        # what ZeRO-3 leaves in each parameter's .data after freeing its gathered copy
        inference = sum(p.data.is_inference() for p in engine.module.parameters())
        engine.module.train()
        batch = ids[:, -8:]
        before = engine(input_ids=batch, labels=batch).loss
        engine.backward(before)
        engine.step()
        after = engine(input_ids=batch, labels=batch).loss
        return {"want": want, "got": got[0, ids.size(1):].tolist(), "inference": inference,
                "before": float(before), "after": float(after)}
    finally:
        engine.destroy()


def sharded_by_an_outer_unit() -> str:
    """The training engine's layout: FSDP2 on each decoder layer and on a loss module around
    the model, so the embeddings and head belong to a unit generate cannot run: refused."""
    from torch.distributed.fsdp import fully_shard

    from easy_context.integrations.hf import CausalLMLoss
    from easy_context.train.engines.fsdp import decoder_layers

    model = tiny_model("llama").eval()
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(CausalLMLoss(model))
    ids, mask = prompts(model.config.vocab_size, (9,))
    try:
        ec.generate(model, ids, attention_mask=mask, method="local", max_new_tokens=2)
    except ValueError as e:
        return str(e)
    return ""
