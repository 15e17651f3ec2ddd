"""The evals on 2 gloo ranks equal one process: needle scores (teacher-forced correct tokens
exactly, answer NLL within fp32 rounding) and perplexity NLL sums (counts exactly)."""

import pytest
import torch

from tests.unit.eval_fixtures import eval_config, random_model_dir


def _needle_both(model_dir: str, method: str) -> tuple[dict, dict]:
    from easy_context.models import load_model_and_tokenizer
    from easy_context.eval.needle import build_haystack, evaluate_needle
    from easy_context.integrations.hf import apply_sequence_parallel

    model, tok = load_model_and_tokenizer(model_dir)
    cfg = eval_config(num_samples=2, depth_interval=0.5)
    hay = build_haystack(tok, 300)
    # The reference: plain attention in this process, no collectives.
    single = evaluate_needle(model, tok, hay, cfg, "data_parallel", progress=False)
    apply_sequence_parallel(model, method)
    sp = evaluate_needle(model, tok, hay, cfg, method, progress=False)
    return single, sp


def _ppl_both(model_dir: str, method: str) -> tuple[list[float], list[float]]:
    from easy_context.models import load_model_and_tokenizer
    from easy_context.eval.ppl import window_stats
    from easy_context.integrations.hf import apply_sequence_parallel

    model, _ = load_model_and_tokenizer(model_dir)
    # 75 tokens: padded to the method's multiple; first=30 leaves rank 0 few scored tokens.
    ids = torch.randint(3, 259, (75,), generator=torch.Generator().manual_seed(0)).tolist()
    single = [window_stats(model, ids, f, "data_parallel", 2, last_k=10).tolist() for f in (1, 30)]
    apply_sequence_parallel(model, method)
    model.train()  # as a script that trains and then evaluates: each change of mode
    model.eval()  # re-kernelized a hybrid's layers loaded with hub kernels (unrouting them)
    sp = [window_stats(model, ids, f, method, 2, last_k=10).tolist() for f in (1, 30)]
    return single, sp


def _hybrid_model_dir(folder: str, family: str) -> str:
    """A tiny hybrid of hf_recurrent_cases.HYBRIDS with the character tokenizer, saved."""
    from tests.unit.eval_fixtures import char_tokenizer

    from .hf_recurrent_cases import tiny_hybrid

    tok = char_tokenizer()
    tiny_hybrid(family, vocab_size=len(tok), tie_word_embeddings=False).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(random_model_dir(tmp_path_factory.getbasetemp() / "ppl_model"))


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_needle_sequence_parallel_equals_single_process(dist2, model_dir, method):
    for single, sp in dist2.run(_needle_both, model_dir, method):
        assert sp["average_score"] == single["average_score"]
        for c1, c2 in zip(single["cells"], sp["cells"]):
            for s1, s2 in zip(c1["samples"], c2["samples"]):
                assert (s2["correct_tokens"], s2["predicted"]) == (s1["correct_tokens"],
                                                                   s1["predicted"])
                assert s2["answer_nll"] == pytest.approx(s1["answer_nll"], rel=1e-5, abs=1e-5)


def test_ppl_sequence_parallel_equals_single_process(dist2, model_dir):
    for single, sp in dist2.run(_ppl_both, model_dir, "zigzag_ring_attn"):
        for a, b in zip(single, sp):
            assert (b[1], b[3]) == (a[1], a[3])  # token counts: exact
            assert b[0] == pytest.approx(a[0], rel=1e-6) and b[2] == pytest.approx(a[2], rel=1e-6)


@pytest.mark.parametrize("family,method", [("qwen3_next", "zigzag_ring_attn"),
                                           ("granite_hybrid", "ulysses_attn"),
                                           ("lfm2", "zigzag_ring_attn")])
def test_ppl_of_hybrid_models_equals_single_process(dist1, dist2, tmp_path, family, method):
    # gated DeltaNet, Mamba-2, short convolutions: loaded with from_pretrained (hub kernels
    # on), switched, then train() and eval(); the old code's recurrent layers ran unrouted
    folder = dist1.run(_hybrid_model_dir, str(tmp_path / family), family)[0]
    for single, sp in dist2.run(_ppl_both, folder, method):
        for a, b in zip(single, sp):
            assert (b[1], b[3]) == (a[1], a[3])  # token counts: exact
            assert b[0] == pytest.approx(a[0], rel=1e-6) and b[2] == pytest.approx(a[2], rel=1e-6)
