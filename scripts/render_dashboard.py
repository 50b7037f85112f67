"""Record a kvstrata cluster's metrics, then draw the Grafana dashboard's panels from them.

    python scripts/render_dashboard.py [--seconds 150] [--out docs/img/grafana-dashboard.png]
    python scripts/render_dashboard.py --from-csv recording.csv   # draw an earlier recording

Grafana cannot be installed here (no registry this project uses ships it), so the picture
in docs/dashboard.md is drawn by this script from recorded metrics, with the dashboard's
own queries:

1. Record. A two-node Ray cluster on loopback (`ray.cluster_utils.Cluster`, each node with
   its metrics export port), a store per node (cpu arena + its own disk directory + one
   `file://` object store they share) and the cluster directory. Probes standing for
   engines (`kvstrata._dev.testing.ChunkProbe`) store one namespace's chunks on node A and
   another's on node B, read them back (arena hits, promotions from disk and the object
   store, misses), and read node A's from node B too (peer and object promotions); one
   holder keeps chunks pinned for a while. Two incidents: the
   object store disappears for a while (failed requests, back-offs, dropped copies, the
   tier down), then node A's disk records are corrupted (checksum failures on promotion).
   Both Ray metrics ports are scraped every `SCRAPE_SECONDS` into a CSV of
   (time, metric, labels, value): what Prometheus would have scraped.
2. Evaluate. The CSV becomes OpenMetrics, `promtool tsdb create-blocks-from openmetrics`
   backfills a Prometheus TSDB in a temp dir, and a Prometheus on 127.0.0.1 (no scrape
   jobs) answers every query of every expanded panel of examples/grafana/kvstrata.json, as
   Grafana would send it: `$node` and `$model` = All, `$__rate_interval` = `RATE_INTERVAL`,
   `$__range` = the recording. A query Prometheus rejects stops the script.
3. Draw. matplotlib (Agg) lays the panels out on the dashboard's grid (gridPos) in
   Grafana's dark colours: time series (stacking, dashed and right-axis overrides), stats,
   bar gauges, state timelines; collapsed rows show only their header.

Needs Prometheus and promtool (Debian: `apt-get install --no-install-recommends
prometheus`; its service is not started here). Everything this starts (Ray, stores,
Prometheus) is stopped by its handle, and its temp dirs, in /tmp and /dev/shm, removed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvstrata and tests helpers, not an installed copy
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray loads: every listener on loopback

DASHBOARD = ROOT / "examples" / "grafana" / "kvstrata.json"
SCRAPE_SECONDS = 5.0
# Grafana's $__rate_interval is max(4 x scrape interval, step + scrape interval). Ray's agent
# exports application metrics every 10 s, so a shorter window counts 2 or 3 exports and draws
# a saw-tooth; 60 s (what a 15 s scrape interval gives) keeps it to about +-10 %.
RATE_INTERVAL = "60s"
SLOT = 64 * 1024
NAMESPACES = ("chat-model", "code-model")  # stand-ins for layout namespaces (digests in production)


# --- 1. record -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chunk_key(namespace: str, index: int) -> bytes:
    from kvstrata.keys import make_key

    return make_key(hashlib.sha256(f"{namespace}/{index}".encode()).digest(), 0)


class Scraper:
    """Scrapes Ray metrics ports every `SCRAPE_SECONDS` into a CSV until stopped."""

    def __init__(self, ports: list[int], path: Path):
        self.ports, self.path = ports, path
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        with open(self.path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["time", "metric", "labels", "value"])
            while True:
                now = time.time()
                for port in self.ports:
                    try:
                        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                    except OSError as exc:
                        print(f"  scrape of port {port} failed: {exc}")
                        continue
                    for family in text_string_to_metric_families(body):
                        for sample in family.samples:
                            if sample.name.startswith("ray_kvstrata_"):
                                out.writerow([f"{now:.3f}", sample.name, json.dumps(sample.labels, sort_keys=True), sample.value])
                f.flush()
                self.scrapes += 1
                if self._stop.wait(max(0.0, SCRAPE_SECONDS - (time.time() - now))):
                    return


def record(seconds: float, csv_path: Path, workdir: Path, shm_dir: str) -> None:
    """Drive a two-node cluster for `seconds` while scraping its metrics into `csv_path`."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvstrata.actors.client import ensure_node_store, get_node_store
    from kvstrata.actors.cluster import down
    from kvstrata.actors.directory import directory_shard
    from kvstrata.protocol import StepRequest
    from kvstrata.config import load_config
    from kvstrata._dev.testing import ChunkProbe
    from kvstrata.tiers.records import HEADER_BYTES
    from tests.utils import flip_disk_payload_bytes

    object_root = workdir / "object"
    object_root.mkdir()

    def config(node: str) -> Any:
        return load_config(
            {
                "tiers": {
                    "cpu": {"capacity": 128 * SLOT, "segment_size": 32 * SLOT, "shm_dir": shm_dir, "prefault": False},
                    "disk": {"path": str(workdir / f"disk-{node}"), "capacity": 384 * (SLOT + HEADER_BYTES)},
                    # auto_mkdir: fsspec's local filesystem does not create the fan-out
                    # directories of a file:// URL by itself (every PUT would fail).
                    "object": {"url": f"file://{object_root}", "storage_options": {"auto_mkdir": True},
                               "capacity": 1024 * SLOT, "index_refresh_seconds": 5, "backoff_max_seconds": 8,
                               "max_attempts": 1},
                },
                "cluster": {"directory_shards": 2, "sync_seconds": 0.5},
                "engine": {"reserve_slots": 16, "lease_seconds": 30},
            }
        )  # fmt: skip

    ports = [free_port(), free_port()]
    sim = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "metrics_export_port": ports[0],
                        "object_store_memory": 128 << 20},
    )  # fmt: skip
    configs = {}
    try:
        sim.add_node(num_cpus=1, metrics_export_port=ports[1], object_store_memory=128 << 20)
        ray.init(address=sim.address, log_to_driver=False, namespace="kvstrata-dashboard")
        sim.wait_for_nodes()
        node_a, node_b = (node.node_id for node in [sim.head_node, *sim.worker_nodes])
        configs = {node_a: config("a"), node_b: config("b")}
        ray.get([directory_shard(s).ping.remote() for s in range(2)], timeout=60)
        for node_id, cfg in configs.items():
            ray.get(ensure_node_store(cfg, node_id).ping.remote(), timeout=120)

        def on(node_id: str) -> dict:
            return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}

        probe = ray.remote(ChunkProbe)
        chat_a = probe.options(**on(node_a)).remote("engine-a1", NAMESPACES[0], SLOT)
        code_b = probe.options(**on(node_b)).remote("engine-b1", NAMESPACES[1], SLOT)
        chat_b = probe.options(**on(node_b)).remote("engine-b2", NAMESPACES[0], SLOT)
        store_a = get_node_store(node_a)
        pinner = ray.get(store_a.register.remote("engine-a3", NAMESPACES[0], SLOT))
        written = {namespace: 0 for namespace in NAMESPACES}
        pinned_slots: list[int] = []
        incidents = {"outage": False, "restored": False, "corrupted": False}
        failed_loads = 0
        rng = random.Random(0)

        def keys(namespace: str, count: int) -> list[bytes]:
            first = written[namespace]
            written[namespace] += count
            return [chunk_key(namespace, i) for i in range(first, first + count)]

        def sample(namespace: str, newest: int, oldest: int, count: int) -> list[bytes]:
            """`count` keys among those written between `oldest` and `newest` chunks ago."""
            high = written[namespace] - newest
            low = max(0, written[namespace] - oldest)
            if high <= low:
                return []
            return [chunk_key(namespace, rng.randrange(low, high)) for _ in range(count)]

        with Scraper(ports, csv_path) as scraper:
            started = time.monotonic()
            iteration = 0
            while (elapsed := time.monotonic() - started) < seconds:
                iteration += 1
                phase = elapsed / seconds
                tick = time.monotonic()
                chat, code = NAMESPACES
                calls = [chat_a.store_chunks.remote(keys(chat, 12), seed=written[chat]),
                         code_b.store_chunks.remote(keys(code, 6), seed=written[code])]  # fmt: skip
                # Reads from the second round on, on both nodes at once: a namespace that comes
                # to a node after another one's pool took the whole arena budget gets no slot
                # there (the arena never shrinks; measured: all of node B's reads of A's chunks
                # were misses when they began 12 s after B's own writes).
                if iteration > 1:
                    reads_a = sample(chat, 0, 48, 8) + sample(chat, 100, 350, 3) + sample(chat, 400, 900, 2)
                    reads_a.append(chunk_key("never-stored", written[chat]))  # a chunk no tier has
                    calls += [chat_a.load_chunks.remote(list(dict.fromkeys(reads_a))),
                              code_b.load_chunks.remote(list(dict.fromkeys(sample(code, 0, 400, 5)))),
                              chat_b.load_chunks.remote(list(dict.fromkeys(sample(chat, 0, 300, 4))))]  # fmt: skip
                for call in calls:
                    try:
                        ray.get(call, timeout=120)
                    except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                        failed_loads += 1
                        print(f"  a probe call failed ({type(exc).__name__}); going on")
                # An engine holds hot chunks pinned for a while (then lets them go); its
                # steps renew its lease.
                hold = 0.25 < phase < 0.55
                request = StepRequest("engine-a3", NAMESPACES[0], epoch=pinner.epoch)
                if hold and not pinned_slots:
                    request.pin = list(dict.fromkeys(sample(chat, 0, 40, 24)))
                elif not hold and pinned_slots:
                    request.unpin, pinned_slots = pinned_slots, []
                reply = ray.get(store_a.step.remote(request), timeout=60)
                pinned_slots += list(reply.pinned.values())
                # Incidents: the object store vanishes, comes back; node A's disk rots.
                if 0.42 < phase and not incidents["outage"]:
                    object_root.rename(workdir / "object-away")
                    object_root.write_text("not a directory: the object store is gone\n")
                    incidents["outage"] = True
                    print(f"  {elapsed:5.0f} s  object store gone")
                if 0.58 < phase and not incidents["restored"]:
                    object_root.unlink()
                    (workdir / "object-away").rename(object_root)
                    incidents["restored"] = True
                    print(f"  {elapsed:5.0f} s  object store back")
                if 0.72 < phase and not incidents["corrupted"]:
                    flipped = flip_disk_payload_bytes(workdir / "disk-a", stride=SLOT)
                    incidents["corrupted"] = True
                    print(f"  {elapsed:5.0f} s  {flipped} disk records of node A corrupted")
                time.sleep(max(0.0, 0.25 - (time.monotonic() - tick)))  # pacing, not synchronisation
            print(f"  {scraper.scrapes} scrapes; {written} chunks written; {failed_loads} probe calls failed")
        for name, node_id in (("A", node_a), ("B", node_b)):
            tiers = ray.get(get_node_store(node_id).stats.remote(), timeout=60)["report"]["tiers"]
            print(f"  node {name} ({node_id[:8]}) hits by tier: "
                  + ", ".join(f"{tier} {fields.get('hits', 0)}" for tier, fields in tiers.items()))  # fmt: skip
        for actor in (chat_a, code_b, chat_b):
            ray.kill(actor)
    finally:
        if ray.is_initialized():
            if configs:
                down(next(iter(configs.values())))  # every store (unlinks its arena), the directory
            ray.shutdown()
        sim.shutdown()


# --- 2. evaluate -----------------------------------------------------------------------------


def openmetrics(csv_path: Path, out: Path) -> tuple[float, float]:
    """The recording as OpenMetrics text (one family per metric, series in time order);
    returns the first and last scrape times."""
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{csv_path} holds no kvstrata samples: did the stores export any?")
    for row in rows:
        series[row["metric"]][row["labels"]].append((float(row["time"]), float(row["value"])))
    with open(out, "w") as f:
        for metric in sorted(series):
            f.write(f"# TYPE {metric} gauge\n")  # PromQL does not care; counters keep their _total
            for labels, points in series[metric].items():
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(json.loads(labels).items()))
                for when, value in sorted(points):
                    f.write(f"{metric}{{{text}}} {value!r} {when:.3f}\n")
        f.write("# EOF\n")
    times = [float(row["time"]) for row in rows]
    return min(times), max(times)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Prometheus:
    """A Prometheus on 127.0.0.1 over a backfilled TSDB, with no scrape jobs; stopped on exit."""

    def __init__(self, workdir: Path, metrics_file: Path):
        for binary in ("prometheus", "promtool"):
            if shutil.which(binary) is None:
                raise SystemExit(f"{binary} not found: apt-get install --no-install-recommends prometheus")
        self.data = workdir / "tsdb"
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(metrics_file), str(self.data)],
                       check=True, capture_output=True)  # fmt: skip
        (workdir / "prometheus.yml").write_text("global:\n  scrape_interval: 5s\n")
        self.port = free_port()
        self.log = open(workdir / "prometheus.log", "w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=3650d"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise SystemExit(f"Prometheus did not start: see {workdir / 'prometheus.log'}") from None
                time.sleep(0.2)  # polling a starting server, bounded by the deadline

    def query(self, expr: str, start: float, end: float, step: float | None) -> list[dict]:
        """A range query (`step`) or an instant one at `end`; raises on an invalid expression."""
        params = {"query": expr, "time": end} if step is None else {"query": expr, "start": start, "end": end, "step": step}
        url = f"http://127.0.0.1:{self.port}/api/v1/{'query' if step is None else 'query_range'}?{urllib.parse.urlencode(params)}"
        try:
            reply = json.loads(urllib.request.urlopen(url, timeout=30).read())
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"Prometheus rejected {expr!r}: {exc.read().decode()}") from None
        return reply["data"]["result"]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


def substitute(expr: str, start: float, end: float) -> str:
    """Grafana's variables as they stand with every node and model selected."""
    for variable, value in (("$__rate_interval", RATE_INTERVAL), ("$__range", f"{math.ceil(end - start)}s"),
                            ("$node", ".*"), ("$model", ".*")):  # fmt: skip
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a dashboard variable this script does not know: {expr}"
    return expr


def panels(items: list[dict]) -> Iterator[dict]:
    for panel in items:
        yield panel
        if not panel.get("collapsed"):  # a collapsed row's panels are not drawn
            yield from panels(panel.get("panels", []))


def evaluate(dashboard: dict, prometheus: Prometheus, start: float, end: float) -> dict[int, list[list[dict]]]:
    """Panel id -> per target, the series Prometheus returned (each with a `legend`)."""
    results: dict[int, list[list[dict]]] = {}
    for panel in panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        per_target = []
        for target in panel["targets"]:
            instant = target.get("instant") and not target.get("range", True)
            found = prometheus.query(substitute(target["expr"], start, end), start, end, None if instant else SCRAPE_SECONDS)
            for series in found:
                series["legend"] = legend(target.get("legendFormat", ""), series["metric"])
            per_target.append(found)
        results[panel["id"]] = per_target
    return results


def legend(template: str, labels: dict[str, str]) -> str:
    text = template if template and template != "__auto" else ",".join(f"{k}={v}" for k, v in labels.items())
    for name, value in labels.items():
        text = text.replace("{{" + name + "}}", value[:8] if name == "node" else value)  # node ids shortened
    return text.replace("{{node}}", "").strip()


# --- 3. draw ---------------------------------------------------------------------------------

from render_panels import draw_dashboard  # noqa: E402 - after sys.path holds this checkout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long to drive the cluster")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "grafana-dashboard.png")
    parser.add_argument("--from-csv", type=Path, help="draw this recording instead of recording one")
    parser.add_argument("--keep-csv", type=Path, help="also save the recording here")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    with tempfile.TemporaryDirectory(prefix="kvstrata-dashboard-") as tmp:
        workdir = Path(tmp)
        csv_path = args.from_csv
        if csv_path is None:
            csv_path = workdir / "recording.csv"
            print(f"recording {args.seconds:.0f} s of a two-node cluster's metrics")
            with tempfile.TemporaryDirectory(prefix="kvstrata-dashboard-", dir="/dev/shm") as shm_dir:
                record(args.seconds, csv_path, workdir, shm_dir)
            if args.keep_csv:
                shutil.copy(csv_path, args.keep_csv)
        start, end = openmetrics(csv_path, workdir / "recording.om")
        prometheus = Prometheus(workdir, workdir / "recording.om")
        try:
            results = evaluate(dashboard, prometheus, start, end)
        finally:
            prometheus.close()
        empty = [panel["title"] for panel in panels(dashboard["panels"]) if panel["type"] != "row"
                 and not any(results[panel["id"]])]  # fmt: skip
        if empty:
            print(f"panels without data in this recording: {empty}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subtitle = (f"Recorded {datetime.fromtimestamp(start):%Y-%m-%d}: {end - start:.0f} s of a two-node cluster on one "
                    f"machine; queries evaluated by Prometheus, drawn by scripts/render_dashboard.py (not Grafana)")  # fmt: skip
        size = draw_dashboard(dashboard, results, start, end, args.out, subtitle)
        print(f"wrote {args.out} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
