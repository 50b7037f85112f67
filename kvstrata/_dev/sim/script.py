"""How the directed scenarios (scenarios.py, scenarios_fixes.py) are written: a `Script`
of named actions over a world, with the round trips and settling the stories repeat, and
`run`, which builds the world, settles it, tells the story and returns what it violated.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata._dev.sim.channel import PENDING
from kvstrata._dev.sim.world import SimConfig, World

# Arena and write policies that keep the stories short: nothing copies chunks down unless
# the arena evicts them (then the copies hold the slot until they land).
QUIET = dict(disk_policy="write_back", object_policy="write_back", flush_signal=(False, False, False))


class Script:
    """Actions by name, with the round trips and settling the stories repeat."""

    def __init__(self, world: World):
        self.w = world
        self.actions: list[tuple] = []  # what ran, replayable (`explore.replay`)

    def do(self, *action: object) -> bool:
        """Run one action and check the world, as a random run does."""
        if not self.w.apply(action):
            return False
        self.actions.append(action)
        self.w.check()
        return True

    def jobs(self) -> None:
        while self.do("job", 0):
            pass

    def round_trip(self, e: int) -> None:
        """The engine's channel sends its next call; the store applies it; the answer returns."""
        assert self.do("send", e), "nothing to send"
        self.deliver(e)
        assert self.do("answer", e, 0)

    def deliver(self, e: int) -> None:
        """The store applies the call the engine's channel awaits (not an older one that timed out)."""
        pending = [c for c in self.w.calls.values() if c.engine == e and c.state == PENDING]
        assert self.do("deliver", e, next(i for i, c in enumerate(pending) if c.awaited))

    def settle(self, e: int) -> None:
        """Round trips until the engine has nothing left to say."""
        for _ in range(8):
            channel = self.w.engines[e].channel
            if channel is None or not channel.busy():  # (None: a deferred start not landed yet)
                return
            self.round_trip(e)

    def settle_all(self, e: int) -> None:
        """Round trips on every channel of the engine (its cache generations in flight) until all are quiet."""
        for _ in range(16):
            open_ = [c for c in self.w.engines[e].channels if not c.closed]
            busy = [i for i, c in enumerate(open_) if c.busy()]
            if not busy:
                return
            assert self.do("send", e, busy[0]), "nothing to send"
            self.deliver(e)
            assert self.do("answer", e, 0)

    def step(self, e: int, settle: bool = True) -> None:
        assert self.do("step", e)
        if settle:
            self.settle(e)

    def land(self, e: int) -> None:
        while self.do("land", e, 0):
            pass

    def store_prompt(self, e: int, prompt: int) -> None:
        """A request of `prompt` computes and stores its chunks; the commit reaches the store."""
        self.do("arrive", e, prompt)
        self.step(e)
        self.land(e)
        self.step(e)
        self.step(e)  # the request finished: its writer pins go back

    def tick(self, seconds: float) -> None:
        self.do("tick", seconds * 1000)

    def acknowledge(self, *engines: int) -> None:
        """Two heartbeats each: the engines learn what left the arena, then acknowledge it."""
        for _ in range(2):
            self.tick(0.25)
            for e in engines:
                self.round_trip(e)

    def reuse(self, *engines: int) -> None:
        """Pressure: another node's burst evicts what nothing pins; once the copies of the
        evicted chunks landed and `engines` saw them go, a second burst overwrites their slots."""
        self.do("crowd", self.w.config.arena_slots)
        self.jobs()
        self.acknowledge(*engines)
        self.do("crowd", self.w.config.arena_slots)


def run(config: SimConfig, story: Callable[[Script], None]) -> list[str]:
    world = World(config)
    try:
        script = Script(world)
        script.jobs()
        for engine in world.engines:
            script.settle(engine.index)
        story(script)
        return world.violations
    finally:
        world.close()
