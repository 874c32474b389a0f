"""Bounds on every request body, and credentials checked before a body is read.

- Each route's body has a size limit: a Content-Length over it is refused (413) before anything is read; a
  body that streams past it (chunked, or lying about its length) is refused when it does.
- A request with a body to an authenticated route needs a valid token first: an unauthenticated 200 MB POST
  costs a header check, not 200 MB of parsing (the workers' routes check the job's own token the same way).
"""

from __future__ import annotations

import re

from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tunewright_api.auth import bearer_token, token_of
from tunewright_api.deps import url_value_refusal
from tunewright_api.errors import ApiError, envelope
from tunewright_api.services import telemetry

DEFAULT_BODY_BYTES = 1 << 20  # a job spec, a plan request, a token request
TELEMETRY_BODY_BYTES = 8 << 20  # one batch of at most MAX_RECORDS_PER_BATCH records
MULTIPART_OVERHEAD_BYTES = 64 << 10  # an upload's form fields and boundaries around the file
PUBLIC = ("/healthz", "/readyz", "/metrics")
WORKER_ROUTE = re.compile(r"^/v1/internal/jobs/(?P<job_id>[^/]+)/")


class RequestLimits:
    def __init__(self, app: ASGIApp, max_upload_bytes: int):
        self.app, self.max_upload_bytes = app, max_upload_bytes

    def limit(self, path: str) -> int:
        if path.rstrip("/") == "/v1/files":
            return self.max_upload_bytes + MULTIPART_OVERHEAD_BYTES
        if WORKER_ROUTE.match(path):
            return TELEMETRY_BODY_BYTES
        return DEFAULT_BODY_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        path, limit = scope["path"], self.limit(scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await envelope(413, f"request body over {limit} bytes", None, "too_large")(scope, receive, send)
            return
        if not path.startswith(PUBLIC):  # a database lookup: off the event loop
            refusal = await run_in_threadpool(self.refusal, scope, path, headers.get("authorization"))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        received = 0

        async def bounded() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, f"request body over {limit} bytes")
            return message

        await self.app(scope, bounded, send)

    def refusal(self, scope: Scope, path: str, authorization: str | None):
        """The 401 a request gets before its body is read (or the 422 of a job id no job can have), or None."""
        worker = WORKER_ROUTE.match(path)
        if worker and (refusal := url_value_refusal("job_id", worker["job_id"])) is not None:
            return envelope(refusal.status, refusal.message, refusal.param, refusal.code)
        with Session(scope["app"].state.engine) as session:
            try:
                if worker:
                    telemetry.authenticated_job(session=session, job_id=worker["job_id"],
                                                token=bearer_token(authorization), finished_ok=True)
                else:
                    token_of(session, authorization)
            except HTTPException as err:
                return envelope(err.status_code, str(err.detail))
            except ApiError as err:
                return envelope(err.status, err.message, err.param, err.code)
        return None
