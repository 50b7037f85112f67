"""The node store's control surface: the calls engines (and other nodes' stores) make,
and the one place that knows the order of a step.

Engines register a namespace, then send one merged control batch per step: holds of
HITs they answered from their mirror, commits, releases, unpins, touches, pins and a
refill of reserved slots (see protocol.py), and the change-log sequence their mirror has
applied, which lets the arena reuse the slots of chunks they saw leave; they
hold a lease that these calls renew, and a clean shutdown returns their holdings at
once (`release_holder`). Other nodes' stores fetch chunks with `export_chunks`.

Owns: the engines' leases and holdings in the arena, the namespaces' pools and layouts,
the cap on an engine's stock of reserved slots (`MAX_RESERVED_SHARE`); who may purge
a namespace (purges.py purges it, after the step's commits).
Invariants: `register` and `step` run under the store lock and first expire dead
engines' leases; a registration binds its holder name to the engine that made it (the
epoch it returns, the store's epoch and a token, must come with every step and the
release; a second engine naming a live holder is refused, while the same engine
registering again -- its answer was lost -- is known by the nonce it sends and gets the
same binding back), until the holder's lease runs out or it is released; a bound
holder's step is applied exactly once per request id: a repeat of the last id is
answered with the answer kept for it, an older id is answered `stale` and applied not at
all (kvstrata/protocol.py); a call during which the store stalled longer than `STALL_SECONDS`
does not count against any lease (leases.py); a step for an unknown namespace or from a holder that is
not bound (a restarted store, an expired lease) is answered with the store's epoch and
nothing else, so the engine registers again (and forgets every pin it had); a bound
holder's step with another epoch is answered with the holder's epoch and nothing else;
a step's holds are taken before its acknowledgement (deferred slot reuse).

The order of a step, which docs/arena-hits.md's safety argument rests on, is
`_apply_step`'s and no other module's: hold -> acknowledge -> commit (and the commits'
copies down) -> purge -> release / unpin / touch -> pin -> uses (reuse admission,
prefetch holds) -> promote -> reserve -> the reply. The parts behind a step -- copies of
committed chunks (cascade.py), promotions (promotion.py), the object-store sweep
(object_index.py) -- are started from here and run in the background: a step never waits
for their I/O (a pin whose chunk is on its way is answered `pending`).
Must not: do the parts' work itself (queueing, pinning for copies, reading into
reserved slots); it calls their public methods, handed in at construction.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvstrata.namespaces import check_holder, check_namespace, check_tenant
from kvstrata.protocol import Registration, StepReply, StepRequest
from kvstrata.store.admission import ReuseAdmission
from kvstrata.store.cascade import Cascade
from kvstrata.store.context import StoreContext, logger
from kvstrata.store.hints import Hints
from kvstrata.store.object_index import ObjectIndex
from kvstrata.store.promotion import Promotion
from kvstrata.store.purges import Purges
from kvstrata.store.registration_check import check_registration
from kvstrata.tiers.arena import SlotPool
from kvstrata.tiers.base import LowerTier
from kvstrata.tiers.changelog import CPU
from kvstrata.tiers.records import chunk_digest

# An engine's stock of free reserved slots is capped at this share of a pool: a larger
# stock evicts chunks only to keep slots empty.
MAX_RESERVED_SHARE = 4
# A call that kept the store busy longer than this is a stall of the store: its time is
# given back to every lease (no engine could renew meanwhile).
STALL_SECONDS = 1.0


@dataclass
class Session:
    """A bound holder's control calls: who registered it, and the last request applied."""

    nonce: str  # the registering engine's own nonce: its registration again is no stranger's
    rid: int = 0  # the last request id applied
    reply: StepReply | None = None  # its answer, sent again if the engine repeats the call
    # namespace -> its purge generation when the holder last heard from this store: commits
    # sent before it heard of a later purge are of chunks stored before that purge.
    generations: dict[str, int] = field(default_factory=dict)


class StoreControl:
    """The calls engines make, over the parts that do the I/O."""

    def __init__(
        self,
        ctx: StoreContext,
        *,
        tiers: Sequence[LowerTier],
        purges: Purges,
        admission: ReuseAdmission,
        cascade: Cascade,
        promotion: Promotion,
        hints: Hints,
        index: ObjectIndex,
    ):
        self._ctx = ctx
        self._tiers = tiers
        self._purges = purges
        self._admission = admission
        self._cascade = cascade
        self._promotion = promotion
        self._hints = hints
        self._index = index
        self.holders: dict[str, str] = {}  # live holder -> the epoch its registration returned (store epoch + token)
        self._sessions: dict[str, Session] = {}  # bound holder -> its session
        self._registered: set[tuple[str, str]] = set()  # (holder, namespace) registered here: who may purge

    def ping(self) -> str:
        return self._ctx.arena.epoch

    def session(self, holder: str) -> Session | None:
        """The bound holder's session (its last request id and kept reply), for the simulation's checks."""
        return self._sessions.get(holder)

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Around each call engines make: a call that took longer than `STALL_SECONDS` (the
        store's own stall) is not counted against any lease."""
        clock = self._ctx.clock
        started = clock()
        try:
            yield
        finally:
            stalled = clock() - started
            if stalled > STALL_SECONDS:
                with self._ctx.lock:
                    self._ctx.arena.leases.discount(stalled)
                logger.warning("kvstrata node store: one call took %.1fs; leases extended by as much", stalled)

    def register(
        self,
        holder: str,
        namespace: str,
        slot_bytes: int,
        layout: Mapping[str, object] | None = None,
        watch: bool = False,
        epoch: str = "",
        nonce: str = "",
    ) -> Registration:
        """Open (or create) the pool of a namespace for an engine and start its lease.

        `watch`: the engine answers HITs from a mirror of the index (a manager); slots are
        then reused only once it acknowledged their chunks' removal.
        `epoch`: the one this holder's live registration returned, if any; a holder name
        that is live here and registered by someone else (another epoch or none) is a
        ValueError: two engines sharing a holder would release each other's pins.
        `nonce`: the registering engine's own secret, the same for all its registrations:
        an engine whose registration's answer was lost (it never learned the epoch) gets
        the same binding again rather than a refusal.
        A bad holder, namespace or `namespace_prefix` is a ValueError naming it (`kvstrata.namespaces`).
        """
        check_holder(holder)
        check_namespace(namespace)
        if layout is not None:
            check_tenant(layout.get("namespace_prefix", ""))
        ctx = self._ctx
        with self.serving(), ctx.lock:
            self.expire()
            check_registration(ctx, namespace, layout)  # registration_check.py: the layout is the namespace's
            bound = self.holders.get(holder)
            session = self._sessions.get(holder)
            if bound is not None and epoch != bound and not (nonce and session is not None and nonce == session.nonce):
                ctx.counters["holders_refused"] += 1
                raise ValueError(
                    f"holder {holder!r} is already registered by another engine on this node store; "
                    "give each engine its own engine_id"
                )
            if bound is None:
                bound = self.holders[holder] = f"{ctx.arena.epoch}.{secrets.token_hex(8)}"
                self._sessions[holder] = Session(nonce)
            self._sessions[holder].generations[namespace] = ctx.generations.current(namespace)
            pool = self._pool(namespace, slot_bytes)
            anchors = (layout or {}).get("anchor_groups")
            pool.positions.set_anchor_groups(anchors)
            # Every tier learns the tenant (`namespace_prefix`) of a namespace, for its
            # quotas, before the namespace's first reservation can grow its share.
            tenant = None if layout is None else str(layout.get("namespace_prefix", ""))
            if tenant is not None:
                ctx.arena.quotas.assign(namespace, tenant)
            for tier in self._tiers:
                tier.configure(namespace, anchors, tenant)
            if layout is not None:
                self._note_layout(namespace, layout)
            self._index.refresh(namespace)
            ctx.arena.renew(holder)
            self._registered.add((holder, namespace))
            seq, changes = ctx.log(namespace).snapshot()
            if watch:
                pool.watch(holder, seq)
            return Registration(
                epoch=bound,
                node_id=ctx.node_id,
                geometry=pool.geometry,
                seq=seq,
                changes=changes,
                slots=self._slots_of(pool, changes),
                indexed=self._index.indexed(namespace),
                lease_seconds=ctx.arena.leases.duration_s,
            )

    def step(self, request: StepRequest) -> StepReply:
        """Apply one (merged) control batch of an engine and answer it (once per request id)."""
        check_holder(request.holder)
        check_namespace(request.namespace)
        ctx = self._ctx
        with self.serving(), ctx.lock:
            self.expire()
            pool = ctx.arena.pools.get(request.namespace)
            bound = self.holders.get(request.holder)
            if pool is None or bound is None:
                # A restarted store forgot the namespace, or the holder's lease ran out (its
                # pins are gone): an epoch other than its own tells the engine to register
                # again and drop what it believed.
                why = "unknown namespace" if pool is None else f"holder {request.holder} not registered in"
                return StepReply(epoch=ctx.arena.epoch, seq=0, rejected=[f"{why} {request.namespace}"])
            if request.epoch != bound:
                # Sent before its engine registered again, or not by its engine: answered
                # with the holder's own epoch (nothing to redo), and nothing applied.
                ctx.counters["holders_refused"] += 1
                rejected = f"holder {request.holder} not registered with epoch {request.epoch!r} in {request.namespace}"
                return StepReply(epoch=bound, seq=0, rejected=[rejected])
            session = self._sessions[request.holder]
            if request.rid and request.rid < session.rid:
                # A call Ray ran late, after its engine moved on: applied never, and no sign
                # that its engine still lives.
                return StepReply(epoch=bound, seq=0, stale=True)
            ctx.arena.renew(request.holder)
            if request.rid and request.rid == session.rid and session.reply is not None:
                return session.reply  # sent again after a timeout or a lost answer: applied once
            reply = self._apply_step(request, pool, bound)
            if request.rid:
                session.rid, session.reply = request.rid, reply
            return reply

    def _apply_step(self, request: StepRequest, pool: SlotPool, bound: str) -> StepReply:
        """Apply one request of a bound holder (under the lock) and build its answer."""
        ctx, counters, generations = self._ctx, self._ctx.counters, self._ctx.generations
        namespace = request.namespace
        if request.recompute_tokens_per_second:
            ctx.recompute_rates[request.holder] = request.recompute_tokens_per_second
        # Holds before anything else, and before the acknowledgement they guard.
        refused = pool.hold(request.holder, request.hold)
        pool.acknowledge(request.holder, request.known_seq)
        counters["engine_pins"] += len(request.hold) - len(refused)
        if refused:
            logger.error(
                "kvstrata node store: %d HITs of %s lost their slot before their pin: %s",
                len(refused), request.holder, refused[0],
            )  # fmt: skip
        committed, rejected = pool.commit_many(request.holder, request.commit)
        heard = self._sessions[request.holder].generations
        if committed and generations.purged_since(namespace, heard.get(namespace, generations.current(namespace))):
            # Stored before its engine heard of a purge of the namespace (a call Ray ran
            # late, an engine that crashed): the slots stay the engine's (its pins), the
            # chunks are not indexed again (purges.py: nothing from before a purge survives it).
            pool.purge([key for key, _ in committed])
            committed = []
        if ctx.audit is not None:
            for key, slot in committed:
                ctx.audit.committed(namespace, key, pool.view(slot))
        if committed:
            self._admission.note_positions(request.positions)  # admission.py: `chain` writes prefix heads
            self._cascade.copy_commits(namespace, pool, committed)
        # After the commits: those sent with a purge were stored before it (purges.py).
        purge_refused = []
        if request.purge and (request.holder, namespace) in self._registered:
            self._purges.purge(namespace)
        elif request.purge:
            # Only an engine of the namespace may empty it (holders are self-asserted,
            # but one that never registered it names no namespace of its own).
            counters["purges_refused"] = counters.get("purges_refused", 0) + 1
            purge_refused.append(f"purge of {namespace} refused: {request.holder} has not registered it")
        self._index.refresh(namespace)
        pool.release(request.holder, request.release)
        pool.unpin(request.holder, request.unpin)
        pool.touch(request.touch)
        pinned = pool.pin(request.holder, request.pin)
        counters["engine_pins"] += len(pinned)
        used = [key for key, _ in request.hold] + list(pinned)
        self._cascade.copy_reused(namespace, pool, used)  # uses: admission.py
        self._hints.step(namespace, pool, used)  # hints.py: held chunks used
        promoting = self._promotion.promote(namespace, pool, [key for key in request.pin if key not in pinned])
        pending = [key for key in request.pin if promoting.get(key)]
        missing = [key for key in request.pin if promoting.get(key) is False]
        counters["pins_missing"] += len(missing)
        self._meter_engine_io(pool, len(request.hold) - len(refused) + len(pinned), len(committed))
        reserve_cap = max(1, pool.max_slots // MAX_RESERVED_SHARE)
        # The engine keeps its stock at or under the cap; slots it is still writing
        # are not counted, so a busy engine's refill is never refused.
        reserved = pool.reserve(request.holder, min(request.reserve, reserve_cap)) if request.reserve else []
        if rejected:
            logger.warning(
                "kvstrata node store: rejected %d commits of %s: %s", len(rejected), request.holder, rejected[0]
            )
        heard[namespace] = generations.current(namespace)  # this answer tells of every purge so far
        log = ctx.log(namespace)
        since = log.since(request.known_seq)
        snapshot = since is None
        seq, changes = log.snapshot() if since is None else since
        return StepReply(
            epoch=bound,
            seq=seq,
            pinned=pinned,
            missing=missing,
            pending=pending,
            reserved=reserved,
            reserve_cap=reserve_cap,
            changes=changes,
            slots=self._slots_of(pool, changes),
            snapshot=snapshot,
            rejected=refused + rejected + purge_refused,
            indexed=self._index.indexed(namespace),
            costs=self._admission.tier_costs(),
        )

    def export_chunks(self, namespace: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes], list[np.ndarray]]:
        """Chunks another node's store asked for: (keys found, their xxh3-128, their bytes).

        A hung disk read here stalls the store's other calls: it is measured (`serving`).

        From the arena, else this node's own lower tiers (the disk, verified on read);
        absent ones are left out. Arena
        chunks go out as views of their slots: Ray copies them into its object store when
        this call returns, before this (single-threaded) actor runs another call, and no
        background thread writes a committed slot -- the one copy on this side. The
        receiver verifies every chunk against its digest anyway.
        """
        with self.serving():
            return self._export_chunks(namespace, keys)

    def _export_chunks(self, namespace: str, keys: list[bytes]) -> tuple[list[bytes], list[bytes], list[np.ndarray]]:
        found: list[bytes] = []
        chunks: list[np.ndarray] = []
        reads: list[tuple[LowerTier, list[bytes]]] = []
        check_namespace(namespace)
        ctx = self._ctx
        with ctx.lock:
            pool = ctx.arena.pools.get(namespace)
            if pool is None:
                return [], [], []
            elsewhere: list[bytes] = []
            for key in keys:
                slot = pool.lookup(key)
                if slot is not None:
                    found.append(key)
                    chunks.append(pool.view(slot))
                else:
                    elsewhere.append(key)
            for tier in self._tiers:
                if not (tier.local and elsewhere):
                    continue
                present = tier.present(namespace, elsewhere)
                if present:
                    reads.append((tier, [key for key in elsewhere if key in present]))
                    elsewhere = [key for key in elsewhere if key not in present]
            slot_bytes = pool.geometry.slot_bytes
        for tier, wanted in reads:
            buffers = [np.empty(slot_bytes, dtype=np.uint8) for _ in wanted]
            read = tier.read_many(namespace, list(zip(wanted, buffers)))
            for key, buffer, ok in zip(wanted, buffers, read):
                if ok:
                    found.append(key)
                    chunks.append(buffer)
        digests = [chunk_digest(namespace, key, chunk) for key, chunk in zip(found, chunks)]
        with ctx.lock:
            ctx.counters["chunks_exported"] += len(found)
        return found, digests, chunks

    def release_holder(self, holder: str, epoch: str) -> None:
        """An engine shutting down cleanly returns its pins and reservations at once
        (`epoch`: its registration's; another's is a ValueError and releases nothing)."""
        check_holder(holder)
        with self._ctx.lock:
            if self.holders.get(holder) != epoch:
                self._ctx.counters["holders_refused"] += 1
                raise ValueError(f"holder {holder!r} is not registered here with that epoch")
            self._unbind(holder)
            self._ctx.arena.release_holder(holder)

    def expire(self) -> None:
        """Drop the holders whose lease ran out (the arena released their pins; callers hold the lock)."""
        for holder in self._ctx.arena.expire():
            self._unbind(holder)

    def _unbind(self, holder: str) -> None:
        self.holders.pop(holder, None)
        self._sessions.pop(holder, None)
        self._ctx.recompute_rates.pop(holder, None)
        self._registered = {entry for entry in self._registered if entry[0] != holder}

    # --- internals -----------------------------------------------------------------------

    def _meter_engine_io(self, pool: SlotPool, served: int, committed: int) -> None:
        """The arena's traffic as the store sees it: chunks handed to engines to load
        (holds and pins) and chunks engines stored; their workers do the copies."""
        slot_bytes = pool.geometry.slot_bytes
        if served:
            self._ctx.io_meter.record("cpu", "read", served * slot_bytes, served)
        if committed:
            self._ctx.io_meter.record("cpu", "write", committed * slot_bytes, committed)

    @staticmethod
    def _slots_of(pool: SlotPool, changes: list[tuple[bytes, str, bool]]) -> dict[bytes, int]:
        """The arena slot of each chunk the changes say is in the CPU tier (the log and the
        pool change together under the store lock, so they agree)."""
        lookup = pool.lookup
        return {key: slot for key, medium, present in changes if medium == CPU and present and (slot := lookup(key)) is not None}

    def _note_layout(self, namespace: str, layout: Mapping[str, object]) -> None:
        """Remember what a namespace is and every model name it is served under; one log
        line when a namespace or a new name for it appears."""
        layouts = self._ctx.layouts
        known = layouts.get(namespace)
        model = str(layout.get("model", ""))
        if known is None:
            layouts[namespace] = {**layout, "models": [model]}
            for tier in self._tiers:
                tier.describe(namespace, dict(layout))
            logger.info(
                "kvstrata node store: namespace %s: model %s, identity %s (%s)",
                namespace, model, layout.get("identity", "none"), layout.get("identity_source") or "name only",
            )  # fmt: skip
        elif model not in known["models"]:
            known["models"].append(model)
            logger.info("kvstrata node store: namespace %s also serves model %s (same identity)", namespace, model)

    def _pool(self, namespace: str, slot_bytes: int) -> SlotPool:
        arena = self._ctx.arena
        known = namespace in arena.pools
        pool = arena.pool(namespace, slot_bytes)
        if not known:
            log = self._ctx.log(namespace)
            pool.on_change = lambda keys, present: log.record_many(keys, CPU, present)
            pool.reuse.seq = lambda: log.seq  # a retired slot waits for the log position of its removal
            self._cascade.attach_write_back(namespace, pool)
        return pool
