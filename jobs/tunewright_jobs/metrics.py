"""Metrics: one small sink interface, a JSONL file sink, an HTTP sink, and a step-phase timer.

Sinks take the typed records of `telemetry.py` and write them as flat JSON objects. Only rank 0 emits.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Protocol

import torch

from tunewright_core.records import TelemetryRecord

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def emit(self, record: TelemetryRecord) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON line per record, flushed at once so a crash loses nothing already emitted.

    On resume the records past the restored step are dropped first: they belong to steps that will be
    trained again, and a step must appear once in the log.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._fh = self.path.open("a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def emit(self, record: TelemetryRecord) -> None:
        self._fh.write(json.dumps(record.model_dump(mode="json")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


RETRIED_HTTP_CODES = {408, 409, 425, 429}  # client errors that a later try can pass
MAX_BACKOFF_SECONDS = 2.0  # an API back from a restart gets the records within this, not after a long sleep
# what `close` gives an unreachable API: long enough for it to restart (the records are in metrics.jsonl too)
FLUSH_SECONDS = 90.0


def refusal_reason(err: urllib.error.HTTPError) -> str:
    """The API's own words on why it refused a batch (its error envelope's message), else the HTTP reason."""
    try:
        return str(json.loads(err.read())["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(err.reason)


class HttpSink:
    """Posts records to the API's telemetry endpoint from a background thread.

    Training never waits on it: records queue in memory (the oldest are dropped past `max_buffered`, and
    counted), failed posts are retried with a backoff of at most MAX_BACKOFF_SECONDS, and `close` keeps
    trying for up to `flush_seconds` (an API restarting meanwhile still gets the last records and the end).
    The per-job token comes from the environment (TUNEWRIGHT_TELEMETRY_TOKEN), never from the config.
    """

    def __init__(self, endpoint: str, token: str | None, max_buffered: int = 100_000,
                 flush_seconds: float = FLUSH_SECONDS, batch: int = 500):
        self.endpoint, self.token = endpoint, token
        self.flush_seconds, self.batch = flush_seconds, batch
        self._queue: deque[dict] = deque(maxlen=max_buffered)
        self.dropped = 0
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tunewright-telemetry", daemon=True)
        self._thread.start()

    def emit(self, record: TelemetryRecord) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(record.model_dump(mode="json"))
        self._wake.set()

    def _post(self, records: list[dict]) -> bool:
        body = json.dumps({"records": records}).encode()
        request = urllib.request.Request(self.endpoint, data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {self.token}"} if self.token else {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = response.read()
            try:
                receipt = json.loads(answer) if answer else {}
            except ValueError:
                receipt = {}
            if isinstance(receipt, dict) and receipt.get("rejected"):  # the API took the rest: say why these were not
                log.warning("telemetry: the API refused %d records: %s", len(receipt["rejected"]),
                            "; ".join(r.get("error", "") for r in receipt["rejected"][:3]))
            return True
        except urllib.error.HTTPError as err:
            if 400 <= err.code < 500 and err.code not in RETRIED_HTTP_CODES:
                # refused for good (bad token, a batch of which the API takes no record): retrying would hold
                # back every record behind this batch, so it is dropped, counted, and why is logged
                log.warning("telemetry: the API refused %d records (%s): dropped: %s", len(records), err.code,
                            refusal_reason(err))
                self.dropped += len(records)
                return True
            log.debug("telemetry post failed: %s", err)
            return False
        except (urllib.error.URLError, OSError) as err:
            log.debug("telemetry post failed: %s", err)
            return False

    def _run(self) -> None:
        backoff = 0.5
        while True:
            self._wake.wait(timeout=backoff)
            self._wake.clear()
            while self._queue:
                records = [self._queue[i] for i in range(min(self.batch, len(self._queue)))]
                if not self._post(records):
                    backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                    break
                for _ in records:
                    self._queue.popleft()
                backoff = 0.5
            if self._closing and (not self._queue or time.monotonic() > self._deadline):
                return

    def close(self) -> None:
        self._deadline = time.monotonic() + self.flush_seconds
        self._closing = True
        self._wake.set()
        self._thread.join(self.flush_seconds + 15)  # one post in flight may take its 10 s timeout
        if self._queue or self.dropped:
            log.warning("telemetry: %d records not delivered, %d dropped", len(self._queue), self.dropped)


class TeeSink:
    def __init__(self, *sinks: MetricsSink):
        self.sinks = sinks

    def emit(self, record: TelemetryRecord) -> None:
        for sink in self.sinks:
            sink.emit(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class NullSink:
    """What ranks other than 0 get."""

    def emit(self, record: TelemetryRecord) -> None:
        pass

    def close(self) -> None:
        pass


class PhaseTimer:
    """Times the device phases of each step without stalling the GPU: CUDA events are read only at log time.

    (Waiting for data is host work and is timed with the host clock by the caller.)
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._steps: list[list[tuple[str | None, object]]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_step(self) -> None:
        self._steps.append([(None, self._now())])

    def mark(self, phase: str) -> None:
        """End the phase named `phase` (it began at the previous mark)."""
        self._steps[-1].append((phase, self._now()))

    def collect(self) -> dict[str, float]:
        """Seconds per phase, summed over the steps since the last collect."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for marks in self._steps:
            for (_, start), (phase, end) in itertools.pairwise(marks):
                seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
                totals[phase] = totals.get(phase, 0.0) + seconds
        self._steps = []
        return totals
