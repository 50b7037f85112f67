"""What disturbs a simulated node, as actions of its world (a mixin of `World`): engines
that pause, crash, reset (and, under `WeightGenerations`, retire old generations, or
finish a deferred start's fingerprint: `identity`), a request preempted, a store copy that fails, weight updates, store
stalls and restarts, another node's burst, a lost registration answer; and `Swallowed`,
which tells a background job that logged and swallowed an exception.

Each action is `act_<name>(*small numbers)`, as in world.py: False if it could not run now.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from kvstrata._dev.sim.engine import SimEngine

CROWD = "sim-crowd"  # the holder of `act_crowd`'s slots


@dataclass
class Stall:
    at: float
    seconds: float


@dataclass
class PurgeWatch:
    """A purge of `namespace`, and its work in flight not run yet: the store's jobs queued
    then (its own included), and the jobs those queue."""

    namespace: str
    jobs: set[int]


class Swallowed:
    """Records what the store's loggers report with an exception while a job runs: a
    background job that catches its own failure and logs it hid a bug from the checks.
    (Each `kvstrata.*` logger's `exception`, and `error` / `warning` with `exc_info`, are
    shadowed on the instance for the job's length: no logging configuration changes.)"""

    METHODS = ("exception", "error", "warning")

    def __init__(self) -> None:
        self.records: list[tuple[BaseException | None, str]] = []
        self._loggers = [
            log for name, log in logging.root.manager.loggerDict.items()
            if name.startswith("kvstrata") and isinstance(log, logging.Logger)
        ]  # fmt: skip

    def _recorder(self, method: str):
        def record(msg, *args, exc_info=None, **kwargs) -> None:
            if method == "exception" or exc_info:
                try:
                    text = str(msg) % args if args else str(msg)
                except (TypeError, ValueError):
                    text = str(msg)
                self.records.append((sys.exc_info()[1], text))

        return record

    def __enter__(self) -> "Swallowed":
        self.records = []
        for log in self._loggers:
            for method in self.METHODS:
                setattr(log, method, self._recorder(method))
        return self

    def __exit__(self, *exc: object) -> None:
        for log in self._loggers:
            for method in self.METHODS:
                log.__dict__.pop(method, None)


class Disturbances:
    """Mixin of `World` (world.py): the disturbing actions."""

    config: Any
    engines: list[SimEngine]

    def act_pause(self, e: int, ms: float) -> bool:
        engine = self._engine(e)
        if engine is None:
            return False
        engine.pause(ms / 1000)
        return True

    def act_crash(self, e: int) -> bool:
        engine = self._engine(e)
        if engine is None:
            return False
        engine.crash()
        for call in self.calls.values():
            if call.engine == engine.index:
                call.awaited = False
        for copy_id in [c for c, copy in self.copies.items() if copy.engine == engine.index]:
            del self.copies[copy_id]
        for manager in engine.strata:
            self.crashed.setdefault(manager.holder, self.clock())
        self.engines[engine.index] = self._start_engine(engine.index)
        return True

    def act_identity(self, e: int) -> bool:
        """The thread of a deferred start (connector/deferred_start.py) finishes: the
        weights' fingerprint is read, the first manager registered and its first slots
        landed; `WeightGenerations` hands over at the engine's next call."""
        engine = self._engine(e)
        if engine is None or not engine.identity_builds:
            return False
        with engine.calls_in():
            engine.identity_builds[0].run()
        return True

    def act_retire(self, e: int, r: int) -> bool:
        """An old cache generation's retiring thread runs (`WeightGenerations`): it waits
        until its channel is idle (or gives up) and shuts the old manager down."""
        engine = self._engine(e)
        if engine is None or not engine.retirements:
            return False
        with engine.calls_in():
            engine.retirements[r % len(engine.retirements)].run()
        for manager in engine.strata:
            if manager._channel.closed:  # retired: what it held is released, or its lease ends
                self.crashed.setdefault(manager.holder, self.clock())
        return True

    def act_preempt(self, e: int, r: int) -> bool:
        engine = self._engine(e)
        return engine is not None and engine.preempt(r)

    def act_fail_copy(self, e: int, r: int) -> bool:
        engine = self._engine(e)
        return engine is not None and engine.fail_copy(r)

    def act_reset(self, e: int) -> bool:
        engine = self._engine(e)
        if engine is None:
            return False
        engine.reset()
        return True

    def act_update_weights(self) -> bool:
        """The weights change in place (an RL weight sync): every engine finishes its copies
        and shuts down, new ones start on the model's new identity (a new namespace, bytes
        of the new generation), and the old namespace is purged on the node (`kvstrata
        purge`) while its work may still be in flight."""
        if not self.config.purge_and_disk_races:
            return False
        for engine in self.engines:  # (a crashed engine was replaced at its crash: all are alive)
            if engine.alive:
                for copy in list(engine.copies.values()):
                    self.land(copy)
                engine.shut_down()
                for call in self.calls.values():
                    if call.engine == engine.index:
                        call.awaited = False
        old = self.namespaces
        self.generation += 1
        self._set_layout()
        for namespace in old:  # (each tenant's)
            self.store.purge(namespace)
            self.purges.append(PurgeWatch(namespace, set(self.jobs.pending)))
        self.served_at = self.clock()
        self.engines = [self._start_engine(i) for i in range(len(self.engines))]
        return True

    def act_stall(self, ms: float) -> bool:
        """The store is busy in one call for `ms` (a long purge, a hung disk read)."""
        self.stalls.append(Stall(self.clock(), ms / 1000))
        with self.store.serving():  # as each engine call is wrapped: a long one is a stall (store/control.py)
            self.advance_to(self.clock() + ms / 1000)
        return True

    def act_restart(self) -> bool:
        """The store process dies and Ray starts a new one: its queued jobs never run; loads
        in flight still read the old segments (workers keep them mapped)."""
        old = self.store
        for executor in (old._io, old._object_io):
            if executor is not None:
                executor.shutdown()
        if old.disk is not None:
            old.disk.close()  # (its checksums in flight are dropped with it)
        self.purges.clear()
        self.store = self._start_store()
        return True

    def act_crowd(self, count: int) -> bool:
        """A burst of another node's work: `count` slots reserved (evicting what it must),
        overwritten and freed again, as a short-lived engine's stores would."""
        pool = self.store.arena.pools.get(self.namespace)
        if pool is None:
            return False
        with self.store._lock:
            self.store._expire()  # as every store call does first
            slots = pool.reserve(CROWD, count)
            for slot in slots:
                self.write(pool.geometry.path_template, slot, "another node's burst")
                pool.view(slot)[:] = 0xEE
            pool.release(CROWD, slots)
        self.served_at = self.clock()
        return True

    def act_lose_registration(self, e: int) -> bool:
        engine = self._engine(e)
        if engine is None:
            return False
        engine.client.lose_next_registration = True
        return True
