"""Seeded runs of the simulation: draw actions, check after each, replay and shrink a failure.

A seed fixes a world (`config_for`) and the order in which actions are drawn (`Explorer`):
what is in flight decides which actions can run, their weights decide how often. A run is
the list of actions that ran; `replay` runs such a list again on a fresh world of the same
config, so a failing run is reproduced by `(seed, actions)` alone, and `shrink` cuts that
list down (delta debugging: drop halves, then quarters, ... while the same check still
fails) to a short trace worth reading.

Determinism: nothing here or in the code under test reads a real clock, starts a thread
or draws from a random source other than the seeded one; iteration over sets of bytes
depends on PYTHONHASHSEED, which `scripts/simulate.py` fixes before replaying a trace
printed by another process.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvstrata._dev.sim.channel import DELIVERED, PENDING
from kvstrata._dev.sim.world import SimConfig, World

Action = tuple


def config_for(seed: int, purge_and_disk_races: bool = True, reach: bool = True) -> SimConfig:
    """The world a seed runs: 1-3 engines, write policies, arena and disk sizes, reset orders;
    with `reach` (issue #51) also which engines are `WeightGenerations` and schedule
    asynchronously, late copies, hints, two tenants and a hybrid model (anchor groups)."""
    rng = random.Random(f"config-{seed}")
    engines = rng.choice((1, 2, 2, 3))
    extra = {}
    if reach:
        late = rng.random() < 0.5
        extra = dict(
            generations=tuple(rng.random() < 0.5 for _ in range(engines)),
            async_scheduling=tuple(rng.random() < 0.3 for _ in range(engines)),
            copy_steps=rng.choice((3, 5)) if late else 2,
            copy_seconds=1.5 if late else 0.25,  # within half a lease (2 s) of the engine's last answer
            hints=rng.random() < 0.7,
        )
    config = SimConfig(**extra,
        engines=engines,
        arena_slots=rng.choice((16, 24, 32)),
        disk_records=rng.choice((16, 32)),
        disk_policy=rng.choice(("write_through", "write_back")),
        object_policy=rng.choice(("write_through", "write_back")),
        reserve_slots=rng.choice((2, 4)),
        flush_signal=tuple(rng.random() < 0.5 for _ in range(engines)),
        purge_and_disk_races=purge_and_disk_races,
    )
    if reach:  # (drawn last: the draws above stay each seed's own)
        config = replace(
            config, tenants=rng.choice((1, 2)), anchors=rng.random() < 0.4, disk_admission=rng.choice(("chain", "always"))
        )
        config = replace(config, deferred=tuple(rng.random() < 0.3 for _ in range(engines)))  # (#50 item 4)
    return config


@dataclass
class Explorer:
    """Draws the next action of a world from the seeded generator."""

    world: World
    rng: random.Random
    weights: dict[str, float] = field(default_factory=dict)

    def next_action(self) -> Action:
        world, rng = self.world, self.rng
        options: list[tuple[float, Callable[[], Action]]] = []
        for engine in world.engines:
            if not engine.alive:
                continue
            e = engine.index
            if world.clock() >= engine.paused_until:
                options.append((10.0, lambda e=e: ("step", e)))
                idle = [c for c in engine.channels if c.awaiting is None and not c.closed]
                if idle:
                    options.append((8.0, lambda e=e, n=len(idle): ("send", e, rng.randrange(n))))
            if len(engine.waiting) < 4:
                options.append((3.0, lambda e=e: ("arrive", e, rng.randrange(len(world.prompts)))))
            if engine.copies:
                options.append((4.0, lambda e=e: ("land", e, rng.randrange(1 << 16))))
                if world.config.hints:  # (the paths of #51 on: failed stores too)
                    options.append((0.2, lambda e=e: ("fail_copy", e, rng.randrange(1 << 16))))
            if engine.retirements:
                options.append((3.0, lambda e=e: ("retire", e, rng.randrange(1 << 16))))
            if engine.identity_builds:
                options.append((1.0, lambda e=e: ("identity", e)))
            if engine.running and world.config.hints:
                options.append((0.3, lambda e=e: ("preempt", e, rng.randrange(1 << 16))))
            if world.config.hints:
                options.append((1.0, lambda e=e: ("hint", e, rng.randrange(4), rng.randrange(len(world.prompts)), rng.randrange(1 << 10))))
                options.append((0.4, lambda e=e: ("warm", e, rng.randrange(4), rng.randrange(len(world.prompts)), rng.randrange(1 << 10))))
            options.append((0.04, lambda e=e: ("pause", e, rng.choice((300, 1500, 3000, 6000, 9000)))))
            options.append((0.02, lambda e=e: ("crash", e)))
            options.append((0.08, lambda e=e: ("reset", e)))
            options.append((0.05, lambda e=e: ("lose_registration", e)))
        duplicable = set()
        for call in world.calls.values():
            e = call.engine
            if call.state == PENDING:
                options.append((8.0 if call.awaited else 1.0, lambda e=e: ("deliver", e, rng.randrange(1 << 16))))
                if call.awaited:
                    options.append((0.4, lambda e=e: ("timeout", e, rng.randrange(1 << 16))))
                    options.append((0.2, lambda e=e: ("fail", e, rng.randrange(1 << 16))))
            elif call.state == DELIVERED and call.awaited:
                options.append((8.0, lambda e=e: ("answer", e, rng.randrange(1 << 16))))
                options.append((0.4, lambda e=e: ("lose", e, rng.randrange(1 << 16))))
            if call.deliveries:
                duplicable.add(e)
        for e in duplicable:
            options.append((0.2, lambda e=e: ("duplicate", e, rng.randrange(1 << 16))))
        if world.hint_calls:
            options.append((4.0, lambda: ("hints",)))
        if world.config.hints:
            options.append((0.03, lambda: ("purge_tenant", rng.randrange(2))))
        if world.jobs.pending:
            options.append((2.0 + len(world.jobs.pending), lambda: ("job", rng.randrange(1 << 16))))
        options.append((6.0, lambda: ("tick", rng.choice((1, 2, 5, 10, 20, 50)))))
        options.append((0.3, lambda: ("tick", rng.choice((300, 800, 1500, 3000)))))
        options.append((0.04, lambda: ("stall", rng.choice((200, 1000, 3000, 6000)))))
        options.append((0.3, lambda: ("crowd", rng.choice((2, 4, 8, 16)))))
        options.append((0.01, lambda: ("restart",)))
        if world.config.purge_and_disk_races:
            options.append((0.03, lambda: ("update_weights",)))
        total = sum(weight for weight, _ in options)
        pick = rng.random() * total
        for weight, make in options:
            pick -= weight
            if pick <= 0:
                return make()
        return options[-1][1]()


@dataclass
class RunResult:
    seed: int
    config: SimConfig
    actions: list[Action]
    violations: list[str]
    events: int
    seconds: float

    def trace(self) -> str:
        """The run, replayable: `scripts/simulate.py --replay` reads this line back."""
        return json.dumps({"seed": self.seed, "config": self.config.__dict__, "actions": self.actions})


def run_seed(
    seed: int, max_events: int, deadline: float | None = None, purge_and_disk_races: bool = True, reach: bool = True
) -> RunResult:
    """Run one seed until a violation, `max_events` actions or the wall-clock `deadline`
    (`reach`: with issue #51's paths, `config_for`)."""
    config = config_for(seed, purge_and_disk_races, reach)
    world = World(config)
    explorer = Explorer(world, random.Random(seed))
    actions: list[Action] = []
    started = time.perf_counter()
    try:
        while len(actions) < max_events and not world.violations:
            if deadline is not None and len(actions) % 256 == 0 and time.perf_counter() > deadline:
                break
            action = explorer.next_action()
            if world.apply(action):
                actions.append(action)
                world.check()
    finally:
        world.close()
    return RunResult(seed, config, actions, world.violations, len(actions), time.perf_counter() - started)


def replay(config: SimConfig, actions: list[Action]) -> list[str]:
    """Run `actions` on a fresh world of `config`; the violations (empty: none)."""
    world = World(config)
    try:
        for action in actions:
            if world.apply(tuple(action)):
                world.check()
            if world.violations:
                break
        return world.violations
    finally:
        world.close()


def same_failure(first: str, other: list[str]) -> bool:
    """Whether `other` fails the way `first` did (the message without its numbers)."""

    def shape(text: str) -> str:
        return "".join(ch for ch in text.split(": ", 1)[-1] if not ch.isdigit())[:60]

    return bool(other) and shape(other[0]).split(" ")[:4] == shape(first).split(" ")[:4]


def shrink(config: SimConfig, actions: list[Action], violation: str, budget_s: float = 60.0) -> list[Action]:
    """A shorter list of actions that still fails the same way: first whole kinds of
    actions go (every tick, every duplicate, ...), then every action of one engine, then
    delta debugging over what is left (drop halves, quarters, ... while it still fails)."""
    deadline = time.perf_counter() + budget_s

    def fails(candidate: list[Action]) -> bool:
        return same_failure(violation, replay(config, candidate))

    current = list(actions)
    groups: list[Callable[[Action], bool]] = []
    for name in sorted({action[0] for action in current}, key=lambda n: -sum(a[0] == n for a in current)):
        groups.append(lambda action, name=name: action[0] == name)
    for e in range(config.engines):
        groups.append(lambda action, e=e: len(action) > 1 and action[0] not in ("job", "tick", "stall", "crowd") and action[1] == e)
    for drop in groups:
        if time.perf_counter() > deadline:
            return current
        candidate = [action for action in current if not drop(action)]
        if len(candidate) < len(current) and fails(candidate):
            current = candidate
    size = max(1, len(current) // 2)
    while time.perf_counter() < deadline:
        # One sweep from the end (the start builds the state the end needs), dropping
        # every run of `size` actions the failure does not need; then finer runs.
        removed = False
        end = len(current)
        while end > 0 and time.perf_counter() < deadline:
            start = max(0, end - size)
            candidate = current[:start] + current[end:]
            if fails(candidate):
                current, removed = candidate, True
            end = start
        if size == 1 and not removed:
            break
        size = max(1, size // 2)
    return current


__all__ = ["Explorer", "RunResult", "config_for", "replace", "replay", "run_seed", "shrink"]
