"""KV hints from requests: vLLM's `kv_hints` envelope, or the same in `kv_transfer_params`.

What each vLLM carries (read from the 0.29.0-0.33.0 wheels): 0.31 and later pass the
request's `KvHintsEnvelope` (`{protocol_version, message_id, actions: [{action_id,
action_type, action_version, payload}]}`, vllm/v1/kv_hints) to the offloading manager as
`ReqContext.kv_hints`; 0.29 and 0.30 have no envelope, and every version passes the
request's `kv_transfer_params` (`ReqContext.kv_transfer_params`: what the OpenAI server
takes as `kv_transfer_params`, or `SamplingParams.extra_args["kv_transfer_params"]`).
vLLM 0.32's OpenAI server does not take `kv_hints` over HTTP, so the same envelope is read
from `kv_transfer_params["kv_hints"]` too, on every version.

Actions (`action_version` 1.x; payloads are JSON):
- `kv.prefetch` (also Dynamo's `kv.fetch`): warm a prefix with no request in flight --
  `token_ids` or `block_hashes` (hex, vLLM's), optional `cache_salt`, `lease_seconds`,
  `deadline_seconds`. Sent when the request arrives.
- `kv.retain`: `priority` 0-100 (default 50) and a TTL (`ttl_seconds`, `duration_seconds`
  or `ttl`: "5m", "1h", "24h", ...) for `token_ranges` ([[start, end], ...]) or
  `token_range` of this request's prompt (default: all of it), or for `token_ids` /
  `block_hashes`. Sent when the request finishes, when its chunks are named (a range
  needs vLLM's key positions: 0.31+).
- `pin` / `unpin` (also `kv.pin` / `kv.unpin`): the same chunk selection as retain.

A malformed action, or one this vLLM cannot serve, is dropped with one log line and the
`hints_dropped` counter; a hint never fails or delays its request: nothing raised while
reading or sending hints leaves `on_new_request` / `on_request_finished`. Every number is
checked finite (hint_bounds.py: an integer beyond a double's range is a malformed hint, not
an OverflowError), and sizes are capped before any hashing: `prefetch.hint_max_actions`
actions and `prefetch.hint_max_tokens` token ids (or block hashes) per request, counted
by their length before a single element is read. The store is the trust boundary: it
checks every action again and caps leases, deadlines and TTLs (store/hints.py).

Invariants: `on_new_request` costs a request without hints two attribute reads; sending is
Ray's asynchronous call (no wait on the scheduler thread); a request's pending actions
are forgotten when it finishes. Must not import vLLM (compat does) or the routing layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata import protocol
from kvstrata.config import PrefetchConfig
from kvstrata.connector.compat import ReqContext, key_positions, prefix_block_hashes
from kvstrata.hint_bounds import seconds
from kvstrata.hint_owners import MAX_TAG_CHARS
from kvstrata.keys import Layout, chunk_keys
from kvstrata.tiers.retention import parse_ttl as retention_ttl

logger = logging.getLogger(__name__)

# kvstrata's action names are the contract's (kvstrata/protocol.py); the keys below are
# the spellings a request may use for them.
PREFETCH, RETAIN, PIN, UNPIN = protocol.PREFETCH_ACTION, protocol.RETAIN_ACTION, protocol.PIN_ACTION, protocol.UNPIN_ACTION
ACTION_TYPES = {
    "kv.prefetch": PREFETCH, "kv.fetch": PREFETCH, "kv.retain": RETAIN,
    "pin": PIN, "kv.pin": PIN, "unpin": UNPIN, "kv.unpin": UNPIN,
}  # fmt: skip
TRANSFER_PARAMS_KEY = "kv_hints"  # kv_transfer_params["kv_hints"]: the envelope, where vLLM has none or HTTP drops it
MAX_ACTIONS = PrefetchConfig().hint_max_actions  # per request, unless the config says otherwise
MAX_RANGES = 64  # token ranges in one action
MAX_HASH_HEX = 128  # hex digits of one block hash (vLLM's are 64)
MAX_SALT_CHARS = 4096
DEFAULT_PRIORITY = 50


class HintError(ValueError):
    """A hint action this engine will not send; says which and why."""


class Budget:
    """What the hints of one request may still name: actions, and token ids or block hashes
    together (`prefetch.hint_max_actions`, `prefetch.hint_max_tokens`)."""

    def __init__(self, actions: int = MAX_ACTIONS, tokens: int = PrefetchConfig().hint_max_tokens):
        self.actions = actions
        self.limit = actions
        self.tokens = tokens
        self.left_out = 0  # actions left out beyond the one error line that names them

    def take(self, count: int, what: str) -> None:
        """Charge `count` token ids (or hashes), or refuse the action before anything is read."""
        if count > self.tokens:
            raise HintError(f"{what}: {count} items, over the {self.tokens} this request's hints may still name")
        self.tokens -= count


@dataclass(frozen=True)
class HintAction:
    """One action, checked and in kvstrata's terms; chunks not yet named."""

    action: str  # PREFETCH, RETAIN, PIN, UNPIN
    token_ids: tuple[int, ...] | None = None  # another prompt's tokens
    block_hashes: tuple[bytes, ...] | None = None  # another prompt's block hashes
    token_ranges: tuple[tuple[int, int], ...] | None = None  # of this request's prompt (None: all of it)
    cache_salt: str | None = None
    priority: int = DEFAULT_PRIORITY
    ttl_seconds: float | None = None
    lease_seconds: float | None = None
    deadline_seconds: float = 0.0

    @property
    def of_this_request(self) -> bool:
        """Whether its chunks are this request's own (named when it finishes)."""
        return self.token_ids is None and self.block_hashes is None


def parse_ttl(value: Any) -> float:
    """Seconds from a number or "300s", "5m", "1h", "24h", "2d" (tiers/retention.py)."""
    try:
        return retention_ttl(value)
    except ValueError as exc:
        raise HintError(str(exc)) from None


def _seconds(value: Any, name: str) -> float:
    try:
        return seconds(value, name)
    except ValueError as exc:
        raise HintError(str(exc)) from None


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise HintError(f"{what} must be a list of non-negative integers")
    return tuple(value)


def _ranges(payload: Mapping[str, Any]) -> tuple[tuple[int, int], ...] | None:
    raw = payload.get("token_ranges")
    if raw is None and payload.get("token_range") is not None:
        raw = [payload["token_range"]]
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)):
        raise HintError("token_ranges must be a list of [start, end] pairs")
    if len(raw) > MAX_RANGES:
        raise HintError(f"{len(raw)} token ranges in one action; at most {MAX_RANGES}")
    ranges = []
    for pair in raw:
        start, end = _ints(pair, "a token range") if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
        if start is None or end <= start:
            raise HintError(f"token range {pair!r} is not [start, end] with start < end")
        ranges.append((start, end))
    return tuple(ranges)


def _sized(value: Any, what: str, budget: Budget | None) -> Any:
    """`value`'s length charged to the request's budget before any element is read."""
    if budget is not None and isinstance(value, (list, tuple)):
        budget.take(len(value), what)
    return value


def parse_action(raw: Any, budget: Budget | None = None) -> HintAction:
    """One envelope action (`KvHintAction` or its JSON form) in kvstrata's terms; with
    `budget`, its token ids or block hashes are charged to the request's (by their length,
    before any is read)."""
    kind = ACTION_TYPES.get(_field(raw, "action_type"))
    if kind is None:
        raise HintError(f"action type {_field(raw, 'action_type')!r} is not one kvstrata serves ({', '.join(ACTION_TYPES)})")
    version = str(_field(raw, "action_version") or "1")
    if version.split(".")[0] != "1":
        raise HintError(f"{_field(raw, 'action_type')} version {version!r}: kvstrata serves version 1")
    payload = _field(raw, "payload") or {}
    if not isinstance(payload, Mapping):
        raise HintError("payload must be a mapping")
    token_ids = None
    if payload.get("token_ids") is not None:
        token_ids = _ints(_sized(payload["token_ids"], "token_ids", budget), "token_ids")
    hashes = None
    if payload.get("block_hashes") is not None:
        raw_hashes = _sized(payload["block_hashes"], "block_hashes", budget)
        well_formed = isinstance(raw_hashes, (list, tuple)) and all(isinstance(h, str) and len(h) <= MAX_HASH_HEX for h in raw_hashes)
        if not well_formed:
            raise HintError(f"block_hashes must be a list of hex strings of at most {MAX_HASH_HEX} digits")
        try:
            hashes = tuple(bytes.fromhex(h) for h in raw_hashes)
        except ValueError:
            raise HintError("block_hashes must be a list of hex strings") from None
    if kind == PREFETCH and token_ids is None and hashes is None:
        raise HintError(f"{_field(raw, 'action_type')} needs token_ids or block_hashes: the prefix to warm")
    salt = payload.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS):
        raise HintError(f"cache_salt must be a string of at most {MAX_SALT_CHARS} characters")
    priority = payload.get("priority", DEFAULT_PRIORITY)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100:
        raise HintError(f"priority must be an integer 0 to 100, got {priority!r}")
    ttl = next((payload[name] for name in ("ttl_seconds", "duration_seconds", "ttl") if payload.get(name) is not None), None)
    if kind == RETAIN and ttl is None:
        raise HintError("kv.retain needs ttl_seconds (or duration_seconds, ttl)")
    lease = payload.get("lease_seconds")
    lease = None if lease is None else _seconds(lease, "lease_seconds") or None
    deadline = payload.get("deadline_seconds")
    deadline = 0.0 if deadline is None else _seconds(deadline, "deadline_seconds")
    return HintAction(
        action=kind,
        token_ids=token_ids,
        block_hashes=hashes,
        token_ranges=_ranges(payload),
        cache_salt=salt,
        priority=priority,
        ttl_seconds=None if ttl is None else parse_ttl(ttl),
        lease_seconds=lease,
        deadline_seconds=deadline,
    )


def envelopes(req_context: ReqContext) -> list[Any]:
    """The hint envelopes a request carries: vLLM's (0.31+) and `kv_transfer_params["kv_hints"]`."""
    found = []
    envelope = getattr(req_context, "kv_hints", None)
    if envelope is not None:
        found.append(envelope)
    params = req_context.kv_transfer_params
    if params and params.get(TRANSFER_PARAMS_KEY) is not None:
        found.append(params[TRANSFER_PARAMS_KEY])
    return found


def parse_envelope(envelope: Any, budget: Budget | None = None) -> tuple[list[HintAction], list[str]]:
    """An envelope's actions, and why each one left out was left out (one reason per action;
    the actions past the request's `budget` of actions are left out)."""
    budget = Budget() if budget is None else budget
    raw = _field(envelope, "actions")
    if not isinstance(raw, (list, tuple)):
        return [], ["the envelope has no list of actions"]
    actions, errors = [], []
    taken = raw[: max(0, budget.actions)]
    budget.actions -= len(taken)
    if len(raw) > len(taken):
        budget.left_out += len(raw) - len(taken) - 1  # one error line for them all, each counted
        errors.append(f"{len(raw) - len(taken)} actions left out: over the request's {budget.limit} (hint_max_actions)")
    for index, item in enumerate(taken):
        try:
            actions.append(parse_action(item, budget))
        except Exception as exc:  # noqa: BLE001 - a hint never raises into vLLM, whatever it holds
            errors.append(f"action {_action_id(item, index)}: {exc}")
    return actions, errors


def _action_id(item: Any, index: int) -> str:
    try:
        ident = _field(item, "action_id")
        return str(ident)[:64] if ident else str(index)
    except Exception:  # noqa: BLE001 - a mapping whose get raises
        return str(index)


class HintIntake:
    """A manager's hints: parsed when a request arrives, sent to the node store as chunk
    keys (`apply_hints`, an asynchronous call), at arrival or, for the request's own
    chunks, when it finishes."""

    def __init__(
        self,
        send: Callable[[str, list[protocol.HintAction]], None] | None,
        layout: Layout,
        counters: dict[str, int],
        limits: PrefetchConfig | None = None,
    ):
        self._send = send
        self._layout = layout
        self._counters = counters
        self._limits = limits or PrefetchConfig()
        self._waiting: dict[str, list[HintAction]] = {}  # req_id -> actions over its own chunks
        self._logged: set[str] = set()

    def on_new_request(self, req_context: ReqContext) -> None:
        try:
            found = envelopes(req_context)
            if found:
                self._on_new_request(req_context, found)
        except Exception as exc:  # noqa: BLE001 - a hint never fails its request nor the engine
            self._waiting.pop(req_context.req_id, None)
            self._drop(req_context.req_id, f"unexpected: {type(exc).__name__}: {exc}")

    def _on_new_request(self, req_context: ReqContext, found: list[Any]) -> None:
        now: list[protocol.HintAction] = []
        budget = Budget(self._limits.hint_max_actions, self._limits.hint_max_tokens)
        for envelope in found:
            actions, errors = parse_envelope(envelope, budget)
            for error in errors:
                self._drop(req_context.req_id, error)
            for action in actions:
                if action.of_this_request:
                    self._waiting.setdefault(req_context.req_id, []).append(action)
                    continue
                try:
                    keys = self._keys_of_prompt(action)
                except Exception as exc:  # noqa: BLE001 - e.g. an xxhash engine with no fixed seed
                    self._drop(req_context.req_id, f"{action.action}: cannot name its chunks: {exc}")
                    continue
                self._name(req_context.req_id, action, keys, now)
        self._counters["hints_dropped"] += budget.left_out
        self._deliver(now)

    def on_request_finished(self, req_context: ReqContext) -> None:
        actions = self._waiting.pop(req_context.req_id, None)
        if not actions:
            return
        try:
            self._on_request_finished(req_context, actions)
        except Exception as exc:  # noqa: BLE001 - a hint never fails its request nor the engine
            self._drop(req_context.req_id, f"unexpected: {type(exc).__name__}: {exc}")

    def _on_request_finished(self, req_context: ReqContext, actions: list[HintAction]) -> None:
        positions = key_positions(req_context)
        out: list[protocol.HintAction] = []
        for action in actions:
            if positions is None:
                self._drop(req_context.req_id, f"{action.action} of this request's tokens needs vLLM 0.31+ (or token_ids)")
                continue
            ranges = action.token_ranges
            keys = [key for key, end in positions.items() if ranges is None or any(s < end <= e for s, e in ranges)]
            self._name(req_context.req_id, action, keys, out)
        self._deliver(out)

    # --- internals ----------------------------------------------------------------------

    def _keys_of_prompt(self, action: HintAction) -> list[bytes] | None:
        """Chunk keys of the prompt an action names, as this engine's scheduler names them."""
        layout = self._layout
        hashes = action.block_hashes
        if hashes is None:
            hashes = prefix_block_hashes(list(action.token_ids), layout.tokens_per_hash, layout.hash_algo, None, None, action.cache_salt)
        chunks = tuple(t * layout.blocks_per_chunk for t in layout.tokens_per_block)
        named = chunk_keys(list(hashes), layout.tokens_per_hash, chunks, layout.group_ids)
        ranges = action.token_ranges
        return [key for key, end in named if ranges is None or any(s < end <= e for s, e in ranges)]

    def _name(self, req_id: str, action: HintAction, keys: list[bytes] | None, out: list[protocol.HintAction]) -> None:
        if not keys:
            self._drop(req_id, f"{action.action} names no whole chunk")
            return
        try:
            out.append(
                protocol.HintAction(
                    action=action.action, keys=keys, priority=action.priority, ttl_seconds=action.ttl_seconds,
                    lease_seconds=action.lease_seconds, deadline_seconds=action.deadline_seconds,
                    # its pins' owner on the store: request:<salt> (hint_owners.py cuts it the same way)
                    owner=(action.cache_salt or "")[:MAX_TAG_CHARS],
                )  # fmt: skip
            )
        except ValueError as exc:  # e.g. more keys than one action may carry
            self._drop(req_id, f"{action.action}: {exc}")

    def _deliver(self, actions: list[protocol.HintAction]) -> None:
        if not actions:
            return
        if self._send is None:
            for action in actions:
                self._drop("", f"{action.action}: this store client takes no hints")
            return
        try:
            self._send(self._layout.namespace, actions)
            self._counters["hints_sent"] += len(actions)
        except Exception as exc:  # noqa: BLE001 - a hint never fails its request
            self._counters["hints_dropped"] += len(actions)
            self._log_once("send", f"kvstrata engine: KV hints not sent to the node store: {type(exc).__name__}: {exc}")

    def _drop(self, req_id: str, why: str) -> None:
        self._counters["hints_dropped"] += 1
        self._log_once(why.split(":")[0], f"kvstrata engine: KV hint of request {req_id} dropped: {why}")

    def _log_once(self, kind: str, line: str) -> None:
        """One line per kind of drop: a client sending bad hints in a loop fills no log."""
        if kind not in self._logged and len(self._logged) < 100:
            self._logged.add(kind)
            logger.warning("%s (further ones counted in hints_dropped, not logged)", line)
