"""Telemetry records and sinks: every record kind survives the JSONL sink and parses back with the contract;
the HTTP sink delivers in order, survives an API that is down for a while, never blocks."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import get_args

from pydantic import TypeAdapter

from tunewright_core.records import (
    CheckpointRecord,
    CommRecord,
    EndRecord,
    EvalMetrics,
    EvalRecord,
    ExportPaths,
    StartRecord,
    StepRecord,
    TelemetryRecord,
    read_records,
)
from tunewright_jobs.metrics import HttpSink, JsonlSink

RECORD = TypeAdapter(TelemetryRecord)
EVAL = EvalMetrics(val_loss=0.5, val_token_accuracy=0.8, exact_match=0.25, exact_match_examples=16)
STEP = StepRecord(step=1, epoch=0, loss=2.5, learning_rate=1e-3, grad_norm=1.5, tokens=400, tokens_per_second=4e3,
                  step_seconds=0.1, data_seconds=0.01, forward_backward_seconds=0.07, optimizer_seconds=0.02)
CHECKPOINT = CheckpointRecord(step=10, uri="/ckpt/test-job/step_00000010", train_loss=1.25, keep_last=2)
ONE_OF_EACH = [
    StartRecord(step=0, total_steps=20, steps_per_epoch=10, strategy="ddp", workers=2, device="cpu",
                micro_batch_size=2, grad_accum=1, global_batch_size=4, seq_len=128, parameters=1000,
                trainable_parameters=100, train_examples=40, truncated_examples=1),
    EvalRecord(step=0, **EVAL.model_dump()),
    STEP,
    CommRecord(step=4, profiled_steps=2, profiled_step_seconds=0.1, comm_share=0.2, comm_share_exposed=0.1,
               comm_seconds_per_step=0.02, exposed_comm_seconds_per_step=0.01, comm_share_max_rank=0.25,
               comm_share_exposed_max_rank=0.15),
    CHECKPOINT,
    EndRecord(step=20, steps=20, final_loss=0.5, eval_before=None, eval_after=EVAL,
              export=ExportPaths(adapter="/out/final/adapter"), strategy="ddp", workers=2, resumed_from_step=10),
]


def test_every_record_kind_round_trips_through_the_jsonl_sink(tmp_path):
    assert {type(r) for r in ONE_OF_EACH} == set(get_args(get_args(TelemetryRecord)[0]))
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for record in ONE_OF_EACH:
        sink.emit(record)
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [RECORD.validate_json(line) for line in lines]
    assert parsed == ONE_OF_EACH  # times included: a record carries its own


def test_a_diverged_loss_is_still_a_record(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.emit(STEP.model_copy(update={"loss": math.nan}))
    sink.close()
    (record,) = read_records(tmp_path / "metrics.jsonl")
    assert math.isnan(record.loss)


class Collector(BaseHTTPRequestHandler):
    received: list = []
    failures_left = 0
    refused_steps: set = set()  # batches holding one of these get a 422, as a record the API refuses would

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Collector.failures_left > 0 or self.headers.get("Authorization") != "Bearer secret":
            Collector.failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        if any(r["step"] in Collector.refused_steps for r in body["records"]):
            self.send_response(422)
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
        sink.emit(CHECKPOINT.model_copy(update={"step": step}))
    assert time.perf_counter() - started < 0.5  # emitting never waits on the network
    sink.close()
    server.shutdown()
    received = [RECORD.validate_python(r) for r in Collector.received]  # the same contract
    assert [r.step for r in received] == list(range(1, 201))


def test_a_refused_batch_is_dropped_and_the_records_after_it_still_arrive():
    Collector.received, Collector.failures_left, Collector.refused_steps = [], 0, {3}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = HttpSink(f"http://127.0.0.1:{server.server_port}/telemetry", "secret", flush_seconds=15, batch=1)
    for step in range(1, 6):
        sink.emit(CHECKPOINT.model_copy(update={"step": step}))
    sink.close()
    server.shutdown()
    Collector.refused_steps = set()
    assert [r["step"] for r in Collector.received] == [1, 2, 4, 5] and sink.dropped == 1


def test_an_unreachable_endpoint_loses_records_but_not_the_run():
    sink = HttpSink("http://127.0.0.1:9/telemetry", "secret", flush_seconds=0.5, max_buffered=10)
    for step in range(25):
        sink.emit(CHECKPOINT.model_copy(update={"step": step}))
    started = time.perf_counter()
    sink.close()
    assert time.perf_counter() - started < 3
    assert sink.dropped == 15
