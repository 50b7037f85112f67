"""A deterministic simulation of engines, their node store and its tiers (issue #37).

One seeded scheduler owns the clock and every point where kvstrata runs concurrently in
production: when each control call is delivered, delayed past its timeout, applied late,
applied with its reply lost, failed or duplicated; when each background job of the store
(disk write, upload, promotion, sweep, purge) runs; when a worker's copy lands; engine
pauses, crashes and resets, store stalls and restarts, eviction under pressure. The real
classes run: `StrataManager` (through its channel seam), `NodeStore` with its arena, disk
and object tiers (through its executor and clock seams). After every event the invariants
of `invariants.py` are checked; a failing run prints a replayable trace and shrinks it.

Outside the layers (like `kvstrata._dev.faults`): it drives the connector, the actors and the
tiers from the outside. Modules: `executors` (background jobs as events), `channel` (control
calls as events), `engine` (a vLLM scheduler and its workers over a manager), `world` (the
store, the engines and every action), `disturbances` and `hints` (a request's KV hints
through the connector, an operator's prefetch and pins, purges of one tenant; their
checks), `invariants`, `explore` (random runs, replay, shrinking), `scenarios` (fixed
interleavings that reproduce the findings of issues #37 and #51), `scenarios_fixes` and
`scenarios_hints` (those of the fixes random runs miss), written with `script`,
`mutation` and `mutants` (the mutation check: every protocol fix reverted by one line,
in a scratch copy, must be found).
"""
