"""Prometheus text exposition for `/metrics`: the API's own request latencies, jobs by status, and each
running job's measured telemetry (what `GET /v1/jobs/{id}/telemetry` reports, as gauges).

The histogram lives in the process (one API replica, as the chart runs it); its route label is the route's
template (`/v1/jobs/{job_id}`), never a raw path, so its series are bounded by the routes.
"""

from __future__ import annotations

import bisect
import threading
import time

from starlette.types import ASGIApp, Receive, Scope, Send

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LatencyHistogram:
    """Seconds per request by (method, route template, status), cumulative as Prometheus wants them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, int], list] = {}  # key -> [bucket counts..., sum, count]

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            series = self._series.setdefault((method, route, status), [0] * len(BUCKETS) + [0.0, 0])
            index = bisect.bisect_left(BUCKETS, seconds)
            if index < len(BUCKETS):
                series[index] += 1
            series[-2] += seconds
            series[-1] += 1

    def lines(self) -> list[str]:
        name = "tunewright_http_request_duration_seconds"
        out = [f"# HELP {name} Time to answer a request, by route template and status.", f"# TYPE {name} histogram"]
        with self._lock:
            snapshot = {key: list(series) for key, series in sorted(self._series.items())}
        for (method, route, status), series in snapshot.items():
            labels = f'method="{method}",route="{route}",status="{status}"'
            cumulative = 0
            for bound, count in zip(BUCKETS, series[:len(BUCKETS)], strict=True):
                cumulative += count
                out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
            out += [f'{name}_bucket{{{labels},le="+Inf"}} {series[-1]}', f"{name}_sum{{{labels}}} {series[-2]:.6f}",
                    f"{name}_count{{{labels}}} {series[-1]}"]
        return out


HISTOGRAM = LatencyHistogram()


class RequestTimer:
    """ASGI middleware: every HTTP request's time into HISTOGRAM, under the route the router matched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            HISTOGRAM.observe(scope["method"], getattr(route, "path", "unmatched"), status,
                              time.perf_counter() - started)


def gauge(name: str, help_text: str, samples: list[tuple[dict[str, str], float | None]]) -> list[str]:
    """A gauge's lines; samples whose value is unknown are left out (absent, not zero)."""
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    for labels, value in samples:
        if value is not None:
            rendered = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{rendered}}} {value}")
    return out


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
