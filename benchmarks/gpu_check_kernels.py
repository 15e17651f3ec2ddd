"""gpu_check, part 1: every attention kernel against the fp32 reference (see gpu_check.py).

Per kernel, dtype, head dim and block shape: forward (out, lse) and backward (dq, dk, dv)
on the views the methods pass (a head group of wider tensors, rows of a longer shard: not
contiguous), GQA 4:1, shard lengths that are not multiples of 8, a causal square block and
a full rectangular one; then packed documents through local attention with that kernel.
Each error (max |x - ref| / max |ref|, ref = the reference kernel in float32 on the same
rounded inputs) stands next to the error of the plain computation in the kernel's dtype
(softmax(q k^T) v with torch matmuls, autograd for the gradients): a kernel is fine when
its error is of that order, not above it.
"""

from __future__ import annotations

import traceback

import torch

from easy_context.attention import available_kernels
from easy_context.attention.contract import Kernel
from easy_context.attention.kernels import CPU_FLASH, REFERENCE
from easy_context.attention.reference import reference_attention

Tensor = torch.Tensor
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kernels_to_check(device: torch.device) -> dict[str, Kernel]:
    """CUDA: torch's ops as easy_context picks them per call (cuda_torch), each of its cuDNN,
    flash and efficient ops, and every installed flash-attn adapter; CPU: torch's CPU flash op."""
    if device.type != "cuda":
        return {"cpu_flash": CPU_FLASH}
    names = ("cuda_torch", "cuda_torch_cudnn", "cuda_torch_flash", "cuda_torch_efficient",
             "flash_attn", "flash_attn_4")
    found = available_kernels()
    return {n: found[n] for n in names if n in found}


def supports(name: str, dtype: torch.dtype, d: int, device: torch.device) -> str | None:
    """Why ``name`` cannot run this case (None: it can)."""
    if name in ("cuda_torch_cudnn", "cuda_torch_flash", "flash_attn", "flash_attn_4") and \
            dtype == torch.float32:
        return "fp16/bf16 only"
    if name == "flash_attn_4" and device.type == "cuda":
        from easy_context.attention.flash_attn_adapters import usable

        if not usable(name, torch.empty(1, 1, 1, d, dtype=dtype, device=device)):
            return "head dim or GPU not supported by flash-attn-4"
    return None


def _rel(x: Tensor, ref: Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _views(b, sq, sk, hq, hkv, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda s, h: torch.randn(b, s + 3, 2 * h, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq)
    # a head group of twice as many heads, rows 3.. of a longer shard: neither contiguous
    return q[:, 3:, hq:], k[:, 3:, hkv:], v[:, 3:, hkv:], do[:, 3:, hq:]


def _plain(q, k, v, dout, causal, scale):
    """The naive computation in the inputs' dtype, autograd for the gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    qh, kh, vh = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), \
        v.repeat_interleave(g, 2).transpose(1, 2)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(),
                          float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    out = (s.softmax(-1) @ vh).transpose(1, 2)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def check_case(kernel: Kernel, dtype, d, causal, sq, sk, hq, hkv, device, seed=0) -> dict:
    q, k, v, dout = _views(2, sq, sk, hq, hkv, d, dtype, device, seed)
    scale = d ** -0.5
    ref_out, ref_lse = REFERENCE.forward(q.float(), k.float(), v.float(), causal, scale)
    ref = (ref_out, ref_lse, *REFERENCE.backward(dout.float(), q.float(), k.float(), v.float(),
                                                 ref_out, ref_lse, causal, scale))
    out, lse = kernel.forward(q, k, v, causal, scale)
    got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, scale))
    plain = _plain(q, k, v, dout, causal, scale)
    names = ("out", "lse", "dq", "dk", "dv")
    shapes_ok = all(g.shape == r.shape for g, r in zip(got, ref)) and out.dtype == dtype \
        and lse.dtype == torch.float32
    row = {"error": {n: _rel(g, r) for n, g, r in zip(names, got, ref)},
           "plain_error": {n: _rel(p, r) for n, p, r in zip(names, plain, ref)},
           "shapes_and_dtypes_ok": shapes_ok}
    row["ratio_to_plain"] = max(row["error"][n] / max(row["plain_error"][n], 1e-7)
                                for n in names if n != "lse")
    return row


def check_documents(name: str, dtype, device, length: int, hq: int, hkv: int, d: int) -> dict:
    """Packed documents (one straddling nothing: lengths 1/5, 1/3, rest, then two short)
    through local attention with this kernel, against float64 attention per document."""
    from easy_context.parallel.local import local_attention

    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, dout = (torch.randn(1, length, h, d, generator=g).to(device=device, dtype=dtype)
                     for h in (hq, hkv, hkv, hq))
    cuts = [0, length // 5, length // 5 + length // 3, length - 7, length - 3, length]
    doc = torch.zeros(1, length, dtype=torch.long, device=device)
    for c in cuts[1:-1]:
        doc[:, c:] += 1
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*ins, causal=True, kernel=name, document_ids=doc)
    out.backward(dout)
    refs = [t.double().detach().requires_grad_() for t in (q, k, v)]
    ref_out = torch.cat([reference_attention(*(t[:, a:b] for t in refs), causal=True)
                         for a, b in zip(cuts, cuts[1:])], dim=1)
    ref_out.backward(dout.double())
    got = (out, *(t.grad for t in ins))
    want = (ref_out, *(t.grad for t in refs))
    return {"length": length, "documents": len(cuts) - 1,
            "error": {n: _rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}}


def run(device: torch.device, tiny: bool, log) -> dict:
    kernels = kernels_to_check(device)
    dims = (64,) if tiny else (64, 128, 256)
    hq, hkv = (8, 2) if tiny else (16, 4)
    shapes = [(True, 37, 37), (False, 37, 53)] if tiny else [(True, 1021, 1021),
                                                             (False, 1021, 2003)]
    dtypes = ("bf16", "fp32") if device.type != "cuda" else ("bf16", "fp16", "fp32")
    rows = []
    for name, kernel in kernels.items():
        for dt in dtypes:
            for d in dims:
                for causal, sq, sk in shapes:
                    row = {"kernel": name, "dtype": dt, "head_dim": d, "causal": causal,
                           "q_rows": sq, "kv_rows": sk, "heads": hq, "kv_heads": hkv}
                    why = supports(name, DTYPES[dt], d, device)
                    if why:
                        rows.append({**row, "skipped": why})
                        continue
                    try:
                        row.update(check_case(kernel, DTYPES[dt], d, causal, sq, sk, hq, hkv,
                                              device))
                    except Exception as e:  # noqa: BLE001 - recorded, the check goes on
                        row["failed"] = f"{type(e).__name__}: {e}"[:500]
                        row["traceback"] = traceback.format_exc(limit=4)[-1500:]
                    rows.append(row)
            log(f"kernels: {name} {dt} done")
    docs = []
    for name in kernels:
        dt = "bf16" if device.type == "cuda" else "fp32"
        try:
            docs.append({"kernel": name, "dtype": dt, **check_documents(
                name, DTYPES[dt], device, 300 if tiny else 3000, hq, hkv, 64)})
        except Exception as e:  # noqa: BLE001
            docs.append({"kernel": name, "dtype": dt, "failed": f"{type(e).__name__}: {e}"[:500]})
    ran = [r for r in rows if "error" in r]
    from easy_context.attention import cuda_ops

    return {"kernels": list(kernels), "rows": rows, "documents": docs,
            # (dtype, head dim, causal) that cuda_torch sent from cuDNN to the flash op
            "cudnn_fell_back": [list(map(str, k)) for k in sorted(cuda_ops._CUDNN_FAILED, key=str)],
            "failed": [f"{r['kernel']} {r['dtype']} D{r['head_dim']}" for r in rows if "failed" in r]
            + [d["kernel"] for d in docs if "failed" in d],
            "worst_ratio_to_plain": max((r["ratio_to_plain"] for r in ran), default=None)}
