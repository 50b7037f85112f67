"""What the manager tells the store about eviction: the order of its touches, and which
pins it no longer needs.

The store evicts its arena in LRU order and never evicts a pinned chunk. This class
records, per request, the chunks it hit or stored (`_note_used`), touches them tail
first when the request finishes (`_touch_tail_first`), and at the end of a step unpins
the chunks no request or load holds (`_release_idle_pins`).

Writes: the fields in `WRITES` below (a test holds the list to the code); `_out_unpin`
gets one unpin per pin the store holds for a local pin (`Pin.grants`). Invariants: rule 1 -- a pin
some request still holds, or with a load in flight, is never released; nor one whose
commit is not answered yet (`Pin.indexing`: released once the mirror has its slot); every
pin that loses its last holder is in `_maybe_idle` by the next step; a pin of an older store
epoch is forgotten, never unpinned (its slot means nothing to the new store); only
chunks the mirror says are resident are touched. Called under the manager's lock, on
the scheduler's thread only; must not call the store (rule 2: the touches and unpins go
out with the step's request) nor read the inbox.
"""

from __future__ import annotations

from kvstrata.connector.compat import ReqContext, key_positions
from kvstrata.connector.manager_state import ManagerState, UsedChunks
from kvstrata.keys import key_group, key_hash


# The state fields this part writes (manager_state.py declares them; tests/connector/
# test_manager_walls.py holds this list to the code, both ways).
WRITES = frozenset({
    "_maybe_idle", "_out_unpin", "_pinned", "_req_used", "_to_hold", "_to_touch"
})  # fmt: skip


class EvictionOrder(ManagerState):
    def _note_used(self, key: bytes, req_context: ReqContext) -> None:
        used = self._req_used.get(req_context.req_id)
        if used is None:  # the request's first: vLLM's record of its positions, read once
            used = self._req_used[req_context.req_id] = UsedChunks(key_positions(req_context))
        used.keys[key] = None

    def _touch_tail_first(self, used: UsedChunks) -> None:
        """Touch a finished request's chunks from its tail to its head, as vLLM's own CPU
        LRU does: a prefix's later chunks (useless without the earlier ones) leave first.
        At one position, the anchor (full-attention) chunk is touched last: a window or
        a state is worth less than the chunk every longer prefix needs.

        Without positions (vLLM < 0.32) a chunk's rank is where its block hash first
        appeared: vLLM offers a request's chunks group by group, each in prefix order,
        and every group's chunk at a position shares that position's hash.
        """
        known = used.positions or {}
        positions = {key: known.get(key) for key in used.keys}
        if None in positions.values():
            first_seen: dict[bytes, int] = {}
            for key in used.keys:
                first_seen.setdefault(key_hash(key), len(first_seen))
            for key, position in positions.items():
                if position is None:
                    positions[key] = first_seen[key_hash(key)]
        anchors = self._anchor_groups

        def rank(key: bytes) -> tuple[int, bool]:
            return (-positions[key], key_group(key) in anchors)

        self._to_touch.extend(key for key in sorted(positions, key=rank) if key in self._mirror)

    def _release_idle_pins(self) -> None:
        """Release the pins no request or load holds any more. Only those that may have
        become idle since the last call are looked at (`_maybe_idle`: every place that
        removes a pin's last holder, or makes a pin with none, adds its key)."""
        candidates, self._maybe_idle = self._maybe_idle, {}
        for key in candidates:
            pin = self._pinned.get(key)
            if pin is None or pin.requests or pin.loads or pin.indexing:
                continue  # (an indexing pin comes back here when its commit is answered: inbox.py)
            del self._pinned[key]
            if not pin.recorded:
                self._to_hold.remove((key, pin.slot))  # never sent: nothing to undo for it
            if pin.epoch == self._epoch:  # one unpin per pin the store holds (most hold one)
                if pin.grants == 1:
                    self._out_unpin.append(pin.slot)
                elif pin.grants:
                    self._out_unpin.extend([pin.slot] * pin.grants)
