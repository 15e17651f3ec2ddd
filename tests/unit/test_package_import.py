"""``import easy_context`` is light, and the methods are transformers attention
implementations whichever of the two packages is imported first (integrations/registration.py).
Each case runs in a fresh interpreter: this one has imported everything already."""

import subprocess
import sys

import pytest

REGISTERED = ("from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as A; "
              "from easy_context.parallel import METHODS; "
              "from easy_context.integrations.hf import hf_attention_name as n; "
              "assert all(n(m) in A for m in METHODS), sorted(A)")


def _python(code: str) -> None:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_import_is_light_and_its_names_resolve_on_use():
    _python("import sys, easy_context as ec, easy_context.data, easy_context.eval; "
            "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; "
            "assert not heavy, heavy; "
            "assert callable(ec.shard_sequence) and 'torch' in sys.modules; "
            "assert set(ec.__all__) <= set(dir(ec))")


@pytest.mark.parametrize("first", ["easy_context", "transformers"])
def test_methods_are_registered_whichever_is_imported_first(first):
    build = ("from transformers import AutoModelForCausalLM, LlamaConfig; "
             "m = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=16, "
             "intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, "
             "num_key_value_heads=2), attn_implementation='zigzag_ring_attn'); "
             "assert m.config._attn_implementation == 'zigzag_ring_attn'")
    order = "import easy_context; " + build if first == "easy_context" else \
        build.replace("; m =", "; import easy_context; m =")
    _python(order + "; " + REGISTERED)


def test_unknown_name_is_an_attribute_error():
    import easy_context

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        easy_context.nope  # noqa: B018
