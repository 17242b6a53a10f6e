"""The chat template: defined once (``chat_template.jinja`` beside this file), rendered as
Hugging Face transformers' ``apply_chat_template`` renders it, and used the same way by SFT data,
generation, the server and the export.

``render(messages, add_generation_prompt)`` gives the text. ``encode_chat(tokenizer, messages)``
gives (token ids, loss mask) for training: the text is cut into prompt pieces and assistant
replies by rendering growing prefixes of the conversation (so any template whose render of a
prefix is a prefix of the whole works), each piece is tokenized on its own, and every reply is
followed by the tokenizer's eos, the token engines stop on. ``encode_prompt`` is the generation
side of the same cut: the prompt up to ``<|assistant|>\\n``, encoded exactly as in training.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """A conversation the template cannot render as training data; str(err) is one line."""


@functools.lru_cache(maxsize=1)
def template_text() -> str:
    return TEMPLATE_PATH.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2.sandbox  # transformers renders chat templates in this sandbox, with these options

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render(messages: list[dict[str, Any]], add_generation_prompt: bool = False,
           template: str | None = None) -> str:
    """The conversation as text. bos/eos render empty: the tokenizer adds them as ids."""
    return _compiled(template or template_text()).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")


def pieces(messages: list[dict[str, Any]], template: str | None = None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_reply) pieces in order; their concatenation is
    ``render(messages)``. A reply piece is an assistant message's text as the template writes it
    (content and closing newline); everything else (role markers, user turns) is prompt."""
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], add_generation_prompt=True, template=template)
        whole = render(messages[:i + 1], template=template)
        if not (prompt.startswith(done) and whole.startswith(prompt)):
            raise ChatError("the chat template does not render a conversation's prefix as a prefix of it; "
                            "its replies cannot be told apart")
        out.append((prompt[len(done):], False))
        out.append((whole[len(prompt):], True))
        done = whole
    rest = render(messages, template=template)[len(done):]
    if rest:
        out.append((rest, False))
    return [(text, reply) for text, reply in out if text or reply]


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                template: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, mask): bos, then each piece tokenized on its own, eos after every reply; mask is
    1 on exactly the reply tokens and their eos (what SFT learns), 0 elsewhere."""
    ids, mask = [np.array([tokenizer.bos_id], np.int32)], [np.zeros(1, np.int32)]
    for text, reply in pieces(messages, template):
        toks = tokenizer.encode(text, add_bos=False, add_eos=reply)
        ids.append(toks)
        mask.append(np.full(toks.size, int(reply), np.int32))
    return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


def encode_prompt(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None) -> np.ndarray:
    """bos + the conversation rendered with the generation prompt: what a model continues with
    its reply, tokenized exactly as ``encode_chat`` tokenizes the same prompt in training."""
    if messages and messages[-1]["role"] == "assistant":
        raise ChatError("the last message is the assistant's: nothing is left to reply to")
    ids = encode_chat(tokenizer, messages + [{"role": "assistant", "content": ""}], template)[0]
    reply = tokenizer.encode(reply_suffix(template), add_bos=False, add_eos=True)
    return ids[:ids.size - reply.size]


@functools.lru_cache(maxsize=8)
def reply_suffix(template: str | None = None) -> str:
    """What the template writes after an assistant reply's content (here "\\n")."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    text = [t for t, reply in pieces(probe, template) if reply][0]
    return text.split("\x00", 1)[1]


def read_reply(text: str, template: str | None = None) -> str:
    """A generated reply (decoded up to eos) without the template's closing text."""
    suffix = reply_suffix(template)
    return text[:-len(suffix)] if suffix and text.endswith(suffix) else text


def instruction_messages(instruction: str, input_text: str = "", output: str | None = None) -> list[dict]:
    """An instruction example (Alpaca style) as a chat: the instruction, then a blank line and the
    input when there is one, as the user's turn; the output as the assistant's."""
    user = f"{instruction}\n\n{input_text}" if input_text else instruction
    messages = [{"role": "user", "content": user}]
    if output is not None:
        messages.append({"role": "assistant", "content": output})
    return messages
