"""Chat / instruction data: the labels train on assistant turns only, both masking methods
agree, prompt/response pairs equal two-turn conversations, streaming equals in-memory."""

from __future__ import annotations

import json
import random
import shutil

import datasets
import numpy as np
import pytest

from easy_context.data import PrepareConfig, UpsampleConfig, prepare_data
from easy_context.data.synthetic import varied_sentence
from tests.unit.data_fixtures import load_tok, tokenizer_dir
from tests.unit.test_data_cli import _run

# A small template in the usual shape: a header per turn, the assistant's text and its
# end-of-turn token inside {% generation %} tags.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The same rendering without the tags: the assistant tokens must then be found by prefixes.
TEMPLATE_NO_TAGS = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Earlier assistant turns render differently once a later turn follows (as templates that
# drop past reasoning do): prefixes cannot find the assistant tokens.
TEMPLATE_SHIFTING = TEMPLATE_NO_TAGS.replace(
    "{{ m['content'] }}{{ eos_token }}",
    "{% if loop.last %}{{ m['content'] }}{% else %}(earlier answer){% endif %}{{ eos_token }}")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(varied_sentence(rng) for _ in range(n))


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            conv.append({"role": "user", "content": _text(rng, rng.randint(1, 6))})
            conv.append({"role": "assistant", "content": _text(rng, rng.randint(1, 12))})
        out.append(conv)
    return out


def write_messages(path, convs) -> None:
    with path.open("w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c, "id": len(c)}) + "\n")


def tokenizer_with_template(root, template: str) -> str:
    """The test tokenizer saved with a chat template of its own."""
    out = root / "tok_chat"
    if not out.exists():
        shutil.copytree(tokenizer_dir(), out)
        tok = load_tok()
        tok.chat_template = template
        tok.save_pretrained(str(out))
    return str(out)


def _columns(path) -> dict[str, np.ndarray]:
    return datasets.load_from_disk(str(path)).with_format("numpy")[:]


def _chat_cfg(inputs, out, **kw) -> PrepareConfig:
    base = dict(inputs=[str(i) for i in inputs], tokenizer=tokenizer_dir(), output=str(out),
                seq_length=96, chat=True, shuffle=False)
    return PrepareConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    convs = conversations(60, seed=5)
    write_messages(root / "chat.jsonl", convs)
    (root / "template.jinja").write_text(TEMPLATE)
    (root / "template_no_tags.jinja").write_text(TEMPLATE_NO_TAGS)
    (root / "template_shifting.jinja").write_text(TEMPLATE_SHIFTING)
    return root, convs


def test_labels_are_the_assistant_turns_and_their_end_tokens(data, tmp_path):
    root, convs = data
    tok = load_tok()
    stats = prepare_data(_chat_cfg([root / "chat.jsonl"], tmp_path / "out",
                                   tokenizer=tokenizer_with_template(root, TEMPLATE)))
    assert stats["chat_mask_method"] == "generation"
    cols = _columns(tmp_path / "out")
    assert set(cols) == {"input_ids", "position_ids", "document_ids", "labels"}
    ids, labels, docs = (cols[k].ravel() for k in ("input_ids", "labels", "document_ids"))
    assert cols["labels"].shape == cols["input_ids"].shape == (stats["windows"], 97)
    assert ((labels == -100) | (labels == ids)).all()
    assert stats["label_tokens_in_windows"] == int((labels != -100).sum()) > 0
    complete = np.unique(docs)[:-1]  # the last document may be cut by the dropped tail
    assert len(complete) > 20
    for d in complete:
        rows = docs == d
        conv = convs[d]
        learned = tok.decode(ids[rows][labels[rows] != -100])
        assert learned == "".join(m["content"] + tok.eos_token for m in conv if m["role"] == "assistant")
        # Everything else -- BOS, headers, system and user turns -- is context only.
        context = tok.decode(ids[rows][labels[rows] == -100])
        assert context.startswith(tok.bos_token)
        assert all(m["content"] in context for m in conv if m["role"] != "assistant")
        assert (cols["position_ids"].ravel()[rows][0] == 0)  # positions restart per conversation


def test_prefix_method_gives_the_same_labels(data, tmp_path):
    root, _ = data
    a = prepare_data(_chat_cfg([root / "chat.jsonl"], tmp_path / "gen",
                               chat_template=str(root / "template.jinja")))
    b = prepare_data(_chat_cfg([root / "chat.jsonl"], tmp_path / "prefix", num_proc=2,
                               chat_template=str(root / "template_no_tags.jinja")))
    assert (a["chat_mask_method"], b["chat_mask_method"]) == ("generation", "prefixes")
    ca, cb = _columns(tmp_path / "gen"), _columns(tmp_path / "prefix")
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


def test_prompt_response_columns_are_two_turn_conversations(data, tmp_path):
    root, _ = data
    rng = random.Random(9)
    pairs = [(_text(rng, rng.randint(1, 5)), _text(rng, rng.randint(1, 9))) for _ in range(40)]
    with (root / "pairs.jsonl").open("w") as f:
        for p, r in pairs:
            f.write(json.dumps({"instruction": p, "output": r}) + "\n")
    write_messages(root / "pairs_as_messages.jsonl",
                   [[{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                    for p, r in pairs])
    template = str(root / "template.jinja")
    assert _run("prepare-data", f"p={root / 'pairs.jsonl'}", "--tokenizer", tokenizer_dir(),
                "--output-dir", str(tmp_path / "pairs"), "--seq-length", "64", "--no-shuffle",
                "--prompt-column", "instruction", "--response-column", "output",
                "--chat-template", template) == 0
    assert _run("prepare-data", f"p={root / 'pairs_as_messages.jsonl'}", "--tokenizer",
                tokenizer_dir(), "--output-dir", str(tmp_path / "msgs"), "--seq-length", "64",
                "--no-shuffle", "--chat", "--chat-template", template) == 0
    ca, cb = _columns(tmp_path / "pairs"), _columns(tmp_path / "msgs")
    assert "labels" in ca
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


def test_chat_streaming_equals_in_memory_with_upsampling(data, tmp_path):
    root, _ = data
    write_messages(root / "more.jsonl", conversations(40, seed=6))
    kw = dict(chat_template=str(root / "template_no_tags.jinja"), shuffle=True, seed=2,
              upsample=UpsampleConfig(threshold=600, keep_prob=0.2), min_length=200)
    inputs = [root / "chat.jsonl", root / "more.jsonl"]
    a = prepare_data(_chat_cfg(inputs, tmp_path / "mem", **kw))
    b = prepare_data(_chat_cfg(inputs, tmp_path / "stream", streaming=True, num_proc=2,
                               batch_size=7, **kw))
    assert max(s["max_copies"] for s in a["sources"]) > 1  # conversations were repeated
    for st in (a, b):
        st.pop("seconds")
    assert a == b
    ca, cb = _columns(tmp_path / "mem"), _columns(tmp_path / "stream")
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


def test_plain_text_has_no_labels_column(data, tmp_path):
    root, _ = data
    (root / "plain.txt").write_text(_text(random.Random(1), 200))
    prepare_data(PrepareConfig(inputs=[str(root / "plain.txt")], tokenizer=tokenizer_dir(),
                               output=str(tmp_path / "plain"), seq_length=32))
    assert "labels" not in datasets.load_from_disk(str(tmp_path / "plain")).column_names


def test_chat_errors_say_what_to_change(data, tmp_path):
    root, _ = data
    chat = root / "chat.jsonl"
    with pytest.raises(ValueError, match="has no chat template; pass --chat-template FILE"):
        prepare_data(_chat_cfg([chat], tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="--chat-template .* is not a file"):
        prepare_data(_chat_cfg([chat], tmp_path / "o", chat_template=str(root / "none.jinja")))
    with pytest.raises(ValueError, match=r"cannot be found by prefixes; wrap the assistant"):
        prepare_data(_chat_cfg([chat], tmp_path / "o",
                               chat_template=str(root / "template_shifting.jinja")))
    with pytest.raises(ValueError, match="--prompt-column and --response-column go together"):
        _chat_cfg([chat], tmp_path / "o", prompt_column="q")
    with pytest.raises(ValueError, match="--chat-template applies to chat data"):
        _chat_cfg([chat], tmp_path / "o", chat=False, chat_template=str(root / "template.jinja"))
    template = str(root / "template.jinja")
    with pytest.raises(ValueError, match=r"no column 'conversation' .*pass --messages-column"):
        prepare_data(_chat_cfg([chat], tmp_path / "o", chat_template=template,
                               messages_column="conversation"))
    (root / "plain.txt").write_text("plain text")
    with pytest.raises(ValueError, match="is plain text; chat data needs .jsonl"):
        prepare_data(_chat_cfg([root / "plain.txt"], tmp_path / "o", chat_template=template))
    bad = root / "bad_messages.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                   + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"document 1: message 0 is not a dict with string"):
            prepare_data(_chat_cfg([bad], tmp_path / "o", chat_template=template,
                                   streaming=streaming))
    bad.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"document 0: column 'messages' is not a non-empty list"):
        prepare_data(_chat_cfg([bad], tmp_path / "o", chat_template=template))
    assert not (tmp_path / "o").exists()
