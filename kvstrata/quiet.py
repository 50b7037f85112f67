"""Quiet example output: the examples' own lines on the terminal, everything else in a log file.

A vLLM engine on the CPU build, with Ray and torch under it, writes a few hundred lines
per start and stop (vLLM's log, Python warnings, Triton and torch notices, progress
bars) from the example's process and the processes it starts (vLLM's engine core and
workers). The examples wrap their work in `quiet_output(name)`, which sends all of it to
one file, `<tmp>/kvstrata-examples/<name>.log` (`KVSTRATA_EXAMPLE_LOG_DIR` overrides the
directory), and says so once at the start.

How: file descriptors 1 and 2 of this process point at the log while the context is open,
so `sys.stdout`, `sys.stderr`, C and C++ code, and every process started meanwhile (which
inherits them) write there. The example prints its own lines to the stream the context
yields, a copy of the original stdout. Ray's own processes and workers (Serve replicas,
actors) do not write here: Ray keeps their output in its session logs
(`/tmp/ray/session_latest/logs`), and the examples call `ray.init(log_to_driver=False)`.

Invariant: on leaving the context, descriptors 1 and 2 are what they were. Warnings of
kvstrata's own loggers in this process are shown on the terminal. If the example raises,
the last lines of the log are shown on the terminal, and the traceback goes there too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

LOG_DIR_ENV = "KVSTRATA_EXAMPLE_LOG_DIR"
TAIL_LINES_ON_FAILURE = 20


def example_log_dir() -> Path:
    """Where the examples' logs go: `$KVSTRATA_EXAMPLE_LOG_DIR`, else `<tmp>/kvstrata-examples`."""
    configured = os.environ.get(LOG_DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "kvstrata-examples"


@contextlib.contextmanager
def quiet_output(name: str, note: str = "") -> Iterator[TextIO]:
    """Send this process's and its children's output to `<log dir>/<name>.log`; yields the
    terminal, a stream for the example's own lines (`print(..., file=terminal)`).

    The log is overwritten by the next run of the same example. `note` is appended to the
    one line that names the log (e.g. where Ray's workers log).
    """
    directory = example_log_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.log"
    print(f"vLLM, Ray and torch messages: {path}{note}", flush=True)

    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved_stdout_fd, saved_stderr_fd = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved_stdout_fd), "w", buffering=1, encoding="utf-8")
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    kvstrata_logger = logging.getLogger("kvstrata")
    own_lines = logging.StreamHandler(terminal)
    own_lines.setLevel(logging.WARNING)
    own_lines.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    kvstrata_logger.addHandler(own_lines)
    failed = False
    try:
        yield terminal
    except BaseException as exc:
        failed = not (isinstance(exc, SystemExit) and exc.code in (None, 0))
        raise
    finally:
        kvstrata_logger.removeHandler(own_lines)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved_stdout_fd, 1)
        os.dup2(saved_stderr_fd, 2)
        os.close(saved_stdout_fd)
        os.close(saved_stderr_fd)
        if failed:
            _show_tail(path, terminal)
        terminal.close()


def _show_tail(path: Path, terminal: TextIO) -> None:
    """The last lines of the log, where vLLM's or Ray's reason for a failure usually is."""
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()[-TAIL_LINES_ON_FAILURE:]
        terminal.write(f"-- the last {len(lines)} lines of {path}:\n" + "".join(f"   {line}\n" for line in lines))
        terminal.flush()
