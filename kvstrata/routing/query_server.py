"""The HTTP face of `query.py`: `POST /query` and `POST /query_by_hash` (Mooncake RFC #1403,
as Dynamo's standalone indexer serves them), for routers outside Ray (Dynamo's, llm-d's, a
gateway) to ask kvstrata where a prompt's KV lives.

    python -m kvstrata.routing.query_server --port 8091

It runs in a process connected to the Ray cluster (`RAY_ADDRESS`), reads the node stores'
figures and the directory's shards every `--refresh-seconds` (the router's `read_cluster`),
and answers each query with one batched directory call. Listens on 127.0.0.1 unless told.

Invariants: a request is answered or refused within `timeout_s` (+ the HTTP round): 400
with `{"error", "field"}` for bad input, 503 while no figures or no directory answer;
the server never blocks on a store (figures come from the background refresh only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstrata.routing.figures import ClusterFigures
from kvstrata.routing.query import QueryError, QueryUnavailable, answer_query, parse_query

logger = logging.getLogger(__name__)
MAX_BODY = 64 << 20  # 64 MiB: a 1M-token prompt as JSON


class QueryServer:
    def __init__(
        self,
        figures: Callable[[], ClusterFigures | None],
        host: str = "127.0.0.1",
        port: int = 0,
        instances: Mapping[str, Sequence[str]] | None = None,
        lora_paths: Mapping[str, str] | None = None,
        hash_seed: str | None = None,
        timeout_s: float = 1.0,
        **answer_kwargs: Any,
    ):
        """`figures()`: the latest cluster figures (None: not read yet)."""
        self._figures = figures
        self._kwargs = {"instances": instances, "lora_paths": lora_paths, "hash_seed": hash_seed,
                        "timeout_s": timeout_s, **answer_kwargs}  # fmt: skip
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="kvstrata-query-loop", daemon=True)
        self._http = ThreadingHTTPServer((host, port), self._handler())
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="kvstrata-query-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._http.server_address[:2]

    def start(self) -> "QueryServer":
        self._loop_thread.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        self._loop.close()

    def answer(self, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON reply) for a POST of `body` to `path`."""
        if path not in ("/query", "/query_by_hash"):
            return 404, {"error": f"no such endpoint {path}; POST /query or /query_by_hash"}
        try:
            query = parse_query(body, by_hash=path == "/query_by_hash")
            figures = self._figures()
            if figures is None:
                return 503, {"error": "kvstrata has not read the cluster's figures yet"}
            future = asyncio.run_coroutine_threadsafe(answer_query(query, figures, **self._kwargs), self._loop)
            return 200, future.result(self._timeout_s + 5)
        except QueryError as exc:
            return 400, {"error": str(exc), "field": exc.field}
        except (QueryUnavailable, TimeoutError) as exc:
            return 503, {"error": f"the cluster directory did not answer: {exc}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._send(413, {"error": f"body over {MAX_BODY} bytes"})
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except ValueError as exc:
                    self._send(400, {"error": f"body: not JSON ({exc})", "field": "body"})
                    return
                self._send(*server.answer(self.path, body))

            def _send(self, status: int, reply: Mapping[str, Any]) -> None:
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                logger.debug("kvstrata query: " + format, *args)

        return Handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvstrata.routing.query_server",
        description="Answer Mooncake RFC #1403 /query and /query_by_hash from kvstrata's cluster directory.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--refresh-seconds", type=float, default=5.0, help="how often the stores' figures are read")
    parser.add_argument("--timeout-seconds", type=float, default=1.0, help="budget of one directory call")
    parser.add_argument("--hash-seed", default=None, help="the engines' PYTHONHASHSEED, where they set one")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    import ray

    from kvstrata.routing.figures import read_cluster

    args = build_parser().parse_args(argv)
    ray.init(address="auto", namespace="kvstrata", logging_level=logging.WARNING)
    latest: list[ClusterFigures | None] = [None]

    async def refresh() -> None:
        while True:
            nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            latest[0] = await read_cluster(nodes, latest[0] or ClusterFigures(), args.refresh_seconds)
            await asyncio.sleep(args.refresh_seconds)

    server = QueryServer(lambda: latest[0], args.host, args.port, hash_seed=args.hash_seed,
                         timeout_s=args.timeout_seconds).start()  # fmt: skip
    print(f"kvstrata query: listening on http://{server.address[0]}:{server.address[1]} (/query, /query_by_hash)")
    try:
        asyncio.run(refresh())
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
