"""The HTTP telemetry sink: delivers in order, survives an API that is down for a while, never blocks."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tunewright_jobs.metrics import HttpSink


class Collector(BaseHTTPRequestHandler):
    received: list = []
    failures_left = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Collector.failures_left > 0 or self.headers.get("Authorization") != "Bearer secret":
            Collector.failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        Collector.received.extend(body["records"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_records_arrive_in_order_after_the_server_recovers():
    Collector.received, Collector.failures_left = [], 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = HttpSink(f"http://127.0.0.1:{server.server_port}/telemetry", "secret", flush_seconds=15)
    started = time.perf_counter()
    for step in range(1, 201):
        sink.emit({"event": "step", "step": step})
    assert time.perf_counter() - started < 0.5  # emitting never waits on the network
    sink.close()
    server.shutdown()
    assert [r["step"] for r in Collector.received] == list(range(1, 201))


def test_an_unreachable_endpoint_loses_records_but_not_the_run():
    sink = HttpSink("http://127.0.0.1:9/telemetry", "secret", flush_seconds=0.5, max_buffered=10)
    for step in range(25):
        sink.emit({"step": step})
    started = time.perf_counter()
    sink.close()
    assert time.perf_counter() - started < 3
    assert sink.dropped == 15
