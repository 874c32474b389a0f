"""The HTTP sink across an API restart: an API that comes back while the run is ending still gets the last
records (no long backoff sleep, no early give-up); a batch the API refuses for good is dropped once, with the
API's reason logged, and never retried."""

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tunewright_core.records import StepRecord
from tunewright_jobs.metrics import MAX_BACKOFF_SECONDS, HttpSink

STEP = StepRecord(step=1, epoch=0, loss=2.5, learning_rate=1e-3, grad_norm=1.5, tokens=400, tokens_per_second=4e3,
                  step_seconds=0.1, data_seconds=0.01, forward_backward_seconds=0.07, optimizer_seconds=0.02)
API_DOWN_SECONDS = 12  # longer than the sink used to try at close (10 s), its backoff grown past 8 s by then


class Api(BaseHTTPRequestHandler):
    received: list = []
    posts = 0
    refusal: dict | None = None  # answered with a 422 carrying this error envelope

    def do_POST(self):  # noqa: N802 (http.server's name)
        Api.posts += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Api.refusal is not None:
            answer = json.dumps(Api.refusal).encode()
            self.send_response(422)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        Api.received.extend(body["records"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # the API stays down past the old flush deadline
def test_an_api_back_from_a_restart_while_the_run_ends_gets_its_last_records():
    Api.received, Api.refusal = [], None
    port = unused_port()  # the API's address, nobody listening: it is restarting
    sink = HttpSink(f"http://127.0.0.1:{port}/telemetry", "secret")
    for step in range(1, 41):
        sink.emit(STEP.model_copy(update={"step": step}))
    closing = threading.Thread(target=sink.close)  # the run has ended: close waits for delivery
    closing.start()
    time.sleep(API_DOWN_SECONDS)
    server = ThreadingHTTPServer(("127.0.0.1", port), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    back = time.monotonic()
    closing.join(timeout=30)
    server.shutdown()
    assert [r["step"] for r in Api.received] == list(range(1, 41))  # the last records, all of them
    assert time.monotonic() - back < MAX_BACKOFF_SECONDS + 2  # delivered at once, not after a long backoff


def test_a_batch_refused_for_good_is_dropped_once_with_the_apis_reason(caplog):
    Api.received, Api.posts = [], 0
    Api.refusal = {"error": {"message": "no record of the batch is valid, none was applied: record 0: step.loss",
                             "type": "invalid_request_error", "param": "records", "code": "no_valid_record"}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = HttpSink(f"http://127.0.0.1:{server.server_port}/telemetry", "secret", flush_seconds=5)
    with caplog.at_level(logging.WARNING, logger="tunewright_jobs.metrics"):
        sink.emit(STEP)
        sink.close()
    server.shutdown()
    Api.refusal = None
    assert Api.posts == 1 and sink.dropped == 1  # not retried: the same batch would be refused again
    assert "no record of the batch is valid" in caplog.text and "422" in caplog.text
