"""Warm a prompt's KV from outside any engine: `kvstrata warm` and `kvstrata.warm.warm`.

Why: an agent's next turn, a nightly batch, a system prompt shared by a deployment -- the
client knows what will be asked before any request is in flight (vLLM #57103: prefetching
at an agent's tool pause captured most of the oracle's gain). `warm` names the prompt's
chunks exactly as the engines of the model on that node name them (the layouts they
registered with the store, vLLM's own block hashes: kvstrata.routing.keys), then asks the
node's store to prefetch them into the arena (held for their first use, under a lease)
and, with a TTL, to retain them in every tier (`kv.retain`), or to pin them.

Invariants: nothing is sent unless the model has engines registered on the node (an error
names the models it has); the prompt's text is tokenized as vLLM tokenizes a completion's
prompt (special tokens added), a chat's messages through the model's chat template.
Must not: start a store or an engine; it needs a running Ray cluster and node store.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kvstrata.protocol import MAX_HINT_KEYS, StoreClient
from kvstrata.routing.figures import node_figures
from kvstrata.routing.keys import chunks_of_prompt
from kvstrata.routing.prompt import Tokenizers, render_token_ids

CALL_TIMEOUT_SECONDS = 30.0
DEFAULT_PRIORITY = 50


class WarmError(RuntimeError):
    """The prompt cannot be warmed: no engine of the model on the node, an unreadable prompt."""


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt: given as ids, or text through `tokenizer` (a chat: a JSON list
    of messages, through its chat template with the generation prompt)."""
    if not isinstance(prompt, str):
        return list(prompt)
    tokenizers = Tokenizers(tokenizer)
    loaded = tokenizers.get()
    if loaded is None:
        raise WarmError(f"cannot load the tokenizer {tokenizer!r}: {tokenizers.error}")
    if not chat:
        return list(loaded.encode(prompt, add_special_tokens=True))
    messages = chat_messages(prompt)
    ids = render_token_ids(loaded, SimpleNamespace(messages=messages, add_generation_prompt=True))
    if ids is None:
        raise WarmError("the chat has content other than text")
    return ids


def chat_messages(text: str) -> list[dict[str, Any]]:
    """A chat prompt's messages: a JSON list of objects, or a WarmError saying what it is instead."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WarmError(f"a chat prompt is a JSON list of messages: {exc}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        kind = type(messages).__name__ if not isinstance(messages, list) else "a list with items that are not objects"
        raise WarmError(f"a chat prompt is a JSON list of messages (objects with role and content), not {kind}")
    return messages


def warm(
    model: str,
    prompt: str | Sequence[int],
    *,
    ttl_s: float | None = None,
    priority: int = DEFAULT_PRIORITY,
    lease_s: float | None = None,
    pin: bool = False,
    chat: bool = False,
    tokenizer: str | None = None,
    cache_salt: str | None = None,
    hash_seed: str | None = None,
    node_id: str | None = None,
    wait_s: float = 30.0,
    tenant: str = "",
) -> list[dict[str, Any]]:
    """Prefetch (or `pin`) a prompt's chunks into a node's arena, and with `ttl_s` retain
    them there and on disk at `priority`; one report per layout namespace of the model.

    The calling process must be in the Ray cluster (`kvstrata.actors.client.join_cluster`).
    `wait_s`: wait this long at most for the moves to land (0: return at once). `tenant`:
    the `namespace_prefix` of the engines whose namespaces to warm (the default tenant, "",
    unless named): a warm lands in that tenant's copy of the model only."""
    from kvstrata.actors.client import store_client

    store = store_client(node_id, CALL_TIMEOUT_SECONDS)
    stats = store.stats()
    figures = node_figures(stats["node_id"], stats)
    namespaces = figures.namespaces(model, tenant)
    if not namespaces:
        known = sorted({m for models in figures.models.values() for m in models})
        tenants = sorted({figures.tenants.get(ns, "") for ns in figures.namespaces(model)})
        if tenants:
            raise WarmError(
                f"no engine of model {model!r} of tenant {tenant!r} has registered with the store on node "
                f"{stats['node_id']} (its tenants there: {', '.join(repr(t) for t in tenants)}); name one with --tenant"
            )
        raise WarmError(
            f"no engine of model {model!r} has registered with the store on node {stats['node_id']} "
            f"(models there: {', '.join(known) or 'none'}); start one first"
        )
    token_ids = prompt_token_ids(prompt, tokenizer or model, chat)
    reports = []
    for namespace in namespaces:
        keys = list(chunks_of_prompt(figures.schemes[namespace], token_ids, seed=hash_seed, cache_salt=cache_salt).keys)
        if not keys:
            raise WarmError(f"the prompt ({len(token_ids)} tokens) holds no whole chunk of namespace {namespace}")
        keys = keys[:MAX_HINT_KEYS]
        report: dict[str, Any] = {"namespace": namespace, "tokens": len(token_ids), "chunks": len(keys)}
        if pin:
            report["pin"] = store.pin_chunks(namespace, keys)
        else:
            report["prefetch"] = store.prefetch(namespace, keys, 0.0, lease_s)
        if ttl_s:
            report["retain"] = store.retain(namespace, keys, priority, ttl_s)
        report["keys"] = keys
        reports.append(report)
    _wait_landed(store, [report["namespace"] for report in reports], wait_s)
    for report in reports:
        held = store.prefetch_holds(report["namespace"])
        report["held"] = sum(1 for key in report.pop("keys") if key in held)
    return reports


def _wait_landed(store: StoreClient, namespaces: list[str], wait_s: float, poll_s: float = 0.05) -> None:
    """Wait until no chunk of `namespaces` is on its way for a prefetch, `wait_s` at most.

    Polled: the store is one actor thread, and a call that blocked it would keep the
    engines' steps -- which free the slots a waiting move needs -- from running."""
    import threading
    import time

    deadline = time.monotonic() + wait_s
    pending = list(namespaces)
    while pending and time.monotonic() < deadline:
        pending = [ns for ns in pending if store.prefetch_pending(ns)]
        if pending:
            threading.Event().wait(poll_s)  # a poll period, bounded by the deadline
