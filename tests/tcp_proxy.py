"""A loopback TCP proxy that can cut a real server off and bring it back.

`weed mini` does not come back on the same port after a restart here, so tests of
recovery put this in front of it instead: `cut()` drops every open connection and
resets new ones (what clients see of a dead server), `restore()` forwards again.
`bytes_per_second` caps what all its connections together carry (both directions share
one budget). The fault matrix's proxy (`kvstrata._dev.faults.proxy`) with two switches.
"""

from __future__ import annotations

from kvstrata._dev.faults.proxy import FaultProxy


class TcpProxy(FaultProxy):
    def cut(self) -> None:
        self.set_mode("refuse", self.bytes_per_second)

    def restore(self) -> None:
        self.set_mode("forward", self.bytes_per_second)
