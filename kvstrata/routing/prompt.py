"""A request's prompt as the token ids its engine will see, in the router's process.

Where they come from, first found wins:
- token ids Serve already has: `request_token_ids` in the call's keyword arguments (Ray
  Serve LLM's direct-streaming ingress tokenizes before routing), or a completion whose
  `prompt` is a list of ids;
- the parsed OpenAI request (`pending_request.args[0]` on Serve LLM's handle path)
  through the model's tokenizer: a completion's `prompt` text encoded with its
  `add_special_tokens` (default True), a chat's `messages` through the chat template
  with `tokenize=True`, `add_generation_prompt`, `continue_final_message`, the request's
  `chat_template` and `chat_template_kwargs` -- what vLLM 0.32's renderer passes to
  `apply_chat_template` for a Hugging Face tokenizer. Message content that is a list of
  parts keeps its text parts, joined by newlines (vLLM's "string" content format).

None where a prompt cannot be had without guessing (a batch of prompts, images,
prompt embeddings, a template that fails): the router then routes without coverage.

Invariants: never raises for a request it cannot read (None instead); the tokenizer is
loaded once per process (`Tokenizers`), off the event loop by the caller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

TOKEN_IDS_KWARG = "request_token_ids"  # what Ray Serve LLM's KV-aware ingress forwards


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(t, int) for t in value)


def given_token_ids(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int] | None:
    """Token ids the request already carries, without a tokenizer."""
    ids = kwargs.get(TOKEN_IDS_KWARG)
    if _is_token_ids(ids):
        return list(ids)
    body = args[0] if args else None
    prompt = getattr(body, "prompt", None)
    if _is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and _is_token_ids(prompt[0]):
        return list(prompt[0])
    return None


def _text_content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            part = part if isinstance(part, Mapping) else getattr(part, "model_dump", lambda: {})()
            if part.get("type") != "text":
                return None  # images, audio, files: not a prompt this router can tokenize
            texts.append(part.get("text", ""))
        return "\n".join(texts)
    return None


def conversation(messages: Sequence[Any]) -> list[dict[str, Any]] | None:
    """OpenAI chat messages as the plain dicts a chat template reads; None if not text only."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = message if isinstance(message, Mapping) else message.model_dump(exclude_none=True)
        text = _text_content(message.get("content"))
        if text is None and message.get("content") is not None:
            return None
        rendered = {k: v for k, v in message.items() if k != "content"}
        rendered["content"] = text if text is not None else ""
        out.append(rendered)
    return out


def render_token_ids(tokenizer: Any, body: Any) -> list[int] | None:
    """A parsed OpenAI request's prompt through `tokenizer`, as vLLM renders it (see above)."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        add_special = getattr(body, "add_special_tokens", True)
        return list(tokenizer.encode(prompt, add_special_tokens=True if add_special is None else add_special))
    messages = getattr(body, "messages", None)
    if not messages:
        return None
    chat = conversation(messages)
    if chat is None:
        return None
    kwargs = dict(getattr(body, "chat_template_kwargs", None) or {})
    kwargs.update(
        add_generation_prompt=getattr(body, "add_generation_prompt", True),
        continue_final_message=getattr(body, "continue_final_message", False),
    )
    tools = getattr(body, "tools", None)
    if tools:
        tools = [t if isinstance(t, Mapping) else t.model_dump(exclude_none=True) for t in tools]
    ids = tokenizer.apply_chat_template(
        chat,
        tools=tools or None,
        chat_template=getattr(body, "chat_template", None),
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return list(ids)


class Tokenizers:
    """The model's tokenizer, loaded once (Hugging Face `AutoTokenizer`), shared by threads."""

    def __init__(self, source: str | None, trust_remote_code: bool = False):
        self.source = source
        self._trust = trust_remote_code
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self.error: str | None = None

    def get(self) -> Any:
        """The tokenizer, loading it on first use (blocking: call off the event loop); None
        without a source or when it cannot be loaded (logged once)."""
        if self.source is None:
            return None
        with self._lock:
            if self._tokenizer is None and self.error is None:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.source, trust_remote_code=self._trust)
                except Exception as exc:  # noqa: BLE001 - routing goes on without coverage
                    self.error = f"{type(exc).__name__}: {exc}"
                    logger.warning("kvstrata router: cannot load the tokenizer %s (%s)", self.source, self.error)
            return self._tokenizer


def prompt_token_ids(args: Sequence[Any], kwargs: Mapping[str, Any], tokenizers: Tokenizers) -> list[int] | None:
    """The prompt's token ids, or None where they cannot be had (see the module's docstring)."""
    ids = given_token_ids(args, kwargs)
    if ids is not None:
        return ids
    tokenizer = tokenizers.get()
    if tokenizer is None or not args:
        return None
    try:
        return render_token_ids(tokenizer, args[0])
    except Exception as exc:  # noqa: BLE001 - a template that rejects the request: vLLM will say so
        logger.debug("kvstrata router: could not render the prompt (%s: %s)", type(exc).__name__, exc)
        return None
