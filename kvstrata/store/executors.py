"""Where the node store runs its background jobs: the seam a test or a simulation replaces.

The store hands every background job to an executor it asks an `ExecutorFactory` for,
once per role at start:

| role | jobs (the store's methods) |
|---|---|
| `disk` | `_write_job` (cascade to disk), `_promote_job` (disk -> arena), `close_purged` (a purged slab's files) |
| `object` | `_upload_job`, `_object_promote_job`, `_scan_job` (the sweep), `_object_purge_job`, manifests |
| `peer` | `_peer_promote_job` |
| `disk-digest` | the disk tier's checksums (`DiskTier(digests=...)`); they block the disk job that waits on them |

Production keeps its threads (`thread_pools`). A test or a seeded simulation passes a
factory (the doubles live in `kvstrata/_dev/executors.py`, outside the wheel) that returns
a `ManualExecutor` for the roles it wants to schedule (nothing runs
until it says which job runs next, so "a write queued before a purge lands after it" is
one line of a test), and for `disk-digest` an executor that runs jobs when submitted
(`InlineExecutor`, or a `ManualExecutor` with `hold` off): a disk write waits on its
digests. A read does not: holding its digests is how a test lands a purge between a
promotion's read and its commit.

Owns: the factory type and the thread pools' names.
Must not: know the store's state; it only runs callables.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

ExecutorFactory = Callable[[str, int], Executor]  # (role, threads) -> the executor of that role


def thread_pools(role: str, threads: int) -> Executor:
    """The production factory: one thread pool per role, named for `ps`/`py-spy`."""
    return ThreadPoolExecutor(threads, thread_name_prefix=f"kvstrata-{role}")
