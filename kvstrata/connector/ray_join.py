"""Joining the Ray cluster from inside a vLLM process, as a guest: vLLM keeps its SIGTERM.

`ray.init` takes a process's SIGTERM over twice: it sets Python's handler to Ray's own
(`sys.exit(15)`), and Ray's core worker installs Abseil's failure-signal handler, which
prints a stack dump ("*** SIGTERM received at time=... PC: @ ...", twice over: to stderr
and through Ray's log) before passing the signal on. In vLLM's engine core SIGTERM is
not a failure but the normal stop request: vLLM's client sends it at every engine
shutdown, and vLLM's handler asks the busy loop to finish cleanly. So an engine with
kvstrata printed two stack dumps per shutdown and stopped through Ray's `sys.exit`
instead of its own path.

Invariant: after `join_cluster_keeping_signals`, the process handles SIGTERM exactly as
before the call, when this call is the one that connected it to Ray. Abseil's handler
stays on the signals that mean a crash (SIGSEGV, SIGABRT, SIGBUS, ...), where its stack
is wanted. A process already connected to Ray (a Ray worker, a driver) is left as Ray set
it up: its SIGTERM handling is Ray's business there.
"""

from __future__ import annotations

import signal
import threading

from kvstrata.actors.client import join_cluster


def join_cluster_keeping_signals(address: str = "auto") -> None:
    """`kvstrata.actors.client.join_cluster`, restoring this process's SIGTERM handler after it.

    Python can set a handler only from the main thread (vLLM builds the scheduler, and
    with it the manager, there); from another thread the join happens unchanged.
    """
    import ray

    if ray.is_initialized() or threading.current_thread() is not threading.main_thread():
        join_cluster(address)
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        join_cluster(address)
    finally:
        # None: the handler was not installed from Python, so there is nothing to put back.
        if previous is not None:
            # Also replaces Abseil's C-level SIGTERM handler with Python's own dispatch.
            signal.signal(signal.SIGTERM, previous)
