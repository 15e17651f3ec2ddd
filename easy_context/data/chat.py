"""Chat / instruction data for prepare-data: conversations -> token ids + a target mask.

A record is a conversation: a ``messages`` list of ``{"role", "content"}`` dicts, or a
prompt and a response column, which become one user turn and one assistant turn. It is
rendered with the tokenizer's chat template (or one given as a file) and tokenized as the
template writes it: the template, not prepare-data, decides BOS and end-of-turn tokens.

The ``labels`` of a conversation equal its ids on the tokens the model must learn to
produce -- every assistant turn, its end-of-turn token included -- and are -100 on
everything else (system and user turns, role headers). Two ways to find those tokens:

  * the template marks assistant text with ``{% generation %}...{% endgeneration %}``:
    ``apply_chat_template(return_assistant_tokens_mask=True)`` maps those character spans
    to tokens;
  * otherwise, by prefixes (the usual incremental way): for assistant turn i, render the
    turns before it with the generation prompt (P) and the turns up to it (F); its tokens
    are those of F after P. That holds only if P's ids begin F's ids and F's begin the
    whole conversation's: checked for every turn, and an error says to add the generation
    tags when a template renders earlier turns differently as the conversation grows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from .tokenize import TokenBatch, token_dtype

IGNORE_INDEX = -100
"""The label of a token the model is not trained to produce (PyTorch's cross-entropy default)."""

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class ChatColumns:
    """Where the conversation is in a record."""

    messages: str = "messages"
    """Column holding a list of {"role", "content"} messages."""
    prompt: str | None = None
    """With ``response``: columns of a single-turn instruction pair (used instead of messages)."""
    response: str | None = None

    @property
    def columns(self) -> list[str]:
        return [self.prompt, self.response] if self.prompt else [self.messages]


def load_chat_template(tokenizer: PreTrainedTokenizerBase, path: str | None = None) -> str:
    """The template to render with: the file at ``path``, else the tokenizer's own."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--chat-template {path} is not a file; pass a Jinja template file")
        return p.read_text(encoding="utf-8")
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path} has no chat template; pass "
                         f"--chat-template FILE with a Jinja chat template")
    return template


def to_conversation(record: dict, cols: ChatColumns, where: str) -> tuple[Conversation, int]:
    """A record as a list of messages (validated), and its number of content characters."""
    if cols.prompt:
        prompt, response = record[cols.prompt], record[cols.response]
        for name, value in ((cols.prompt, prompt), (cols.response, response)):
            if not isinstance(value, str):
                raise ValueError(f"{where}: column {name!r} holds {type(value).__name__}, not text; "
                                 f"pass --prompt-column/--response-column naming text columns")
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": response}], len(prompt) + len(response)
    messages = record[cols.messages]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: column {cols.messages!r} is not a non-empty list of messages; "
                         f'each record needs {cols.messages!r}: [{{"role": ..., "content": ...}}, ...] '
                         f"(or pass --prompt-column and --response-column)")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {i} is not a dict with string 'role' and "
                             f"'content' (got {m!r:.80}); fix the record")
        # Arrow gives every message every key seen in the column (None where absent).
        out.append({k: v for k, v in m.items() if v is not None})
        chars += len(m["content"])
    return out, chars


class ChatTokenizer:
    """Picklable callable: conversations -> :class:`TokenBatch` with ``labels``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.dtype = token_dtype(tokenizer)
        # The offsets that map generation spans to tokens exist only in fast tokenizers.
        self.method = ("generation" if _GENERATION_TAG.search(template) and tokenizer.is_fast
                       else "prefixes")

    def _ids(self, messages: Sequence, add_generation_prompt: bool = False) -> list[int]:
        return self.tokenizer.apply_chat_template(
            list(messages), chat_template=self.template, tokenize=True, return_dict=False,
            add_generation_prompt=add_generation_prompt)

    def _by_prefixes(self, conv: Conversation) -> tuple[list[int], list[int]]:
        ids = self._ids(conv)
        mask = [0] * len(ids)
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise ValueError("a conversation starts with an assistant message, which a "
                                 "template without {% generation %} tags cannot mask; start it "
                                 "with a user or system message, or add the tags (--chat-template)")
            before, upto = self._ids(conv[:i], add_generation_prompt=True), self._ids(conv[: i + 1])
            if upto[: len(before)] != before or ids[: len(upto)] != upto:
                raise ValueError(
                    f"the chat template renders turn {i} differently once later turns follow "
                    f"(or the generation prompt is not how an assistant turn starts), so the "
                    f"assistant tokens cannot be found by prefixes; wrap the assistant content "
                    f"and its end-of-turn token in {{% generation %}}...{{% endgeneration %}} "
                    f"and pass the template with --chat-template")
            mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
        return ids, mask

    def __call__(self, conversations: list[Conversation]) -> TokenBatch:
        if self.method == "generation":
            out = self.tokenizer.apply_chat_template(
                conversations, chat_template=self.template, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
            ids, masks = out["input_ids"], out["assistant_masks"]
        else:
            ids, masks = zip(*map(self._by_prefixes, conversations)) if conversations else ((), ())
        for conv, mask in zip(conversations, masks):
            if not any(mask) and any(m["role"] == "assistant" for m in conv):
                raise ValueError("the chat template's {% generation %} tags mark no token of a "
                                 "conversation with an assistant turn; put them around the "
                                 "assistant content (--chat-template)")
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter((t for x in ids for t in x), dtype=self.dtype, count=int(lengths.sum()))
        learn = np.fromiter((b for x in masks for b in x), dtype=bool, count=len(tokens))
        return TokenBatch(tokens, lengths, np.where(learn, tokens, IGNORE_INDEX).astype(self.dtype))
