"""One error envelope for every route, OpenAI's: {"error": {"message", "type", "param", "code"}}.

An invalid request is a 422 on the native routes and a 400 on the OpenAI-compatible ones, as OpenAI answers
it (its client raises BadRequestError for a 400, and a class of its own for a 422)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tunewright_core.spec import described_errors

log = logging.getLogger(__name__)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 409: "conflict_error", 410: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 503: "server_busy_error"}


OPENAI_ROUTES = ("/v1/files", "/v1/fine_tuning/")


def surface_status(path: str, status: int) -> int:
    """The status an error gets on the route at `path`: OpenAI's surface says 400 where the native one says 422."""
    return 400 if status == 422 and path.startswith(OPENAI_ROUTES) else status


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def envelope(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": code}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def body_model(request: Request) -> type[BaseModel] | None:
    """The model the request's route reads its JSON body into (FastAPI's own when it reads several)."""
    body = getattr(request.scope.get("route"), "body_field", None)
    annotation = body.field_info.annotation if body else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return envelope(surface_status(request.url.path, exc.status), exc.message, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return envelope(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is a character position, not a field
            return envelope(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')} "
                                 f"(character {first['loc'][-1]})", None, "invalid_json")
        body = body_model(request)
        if body is not None and all(e["loc"][:1] == ("body",) for e in exc.errors()):
            said = described_errors(exc.errors(), body, skip=1)  # one per field, each named as it was written
        else:  # a query's or a path's (or a body FastAPI reads as several)
            said = [(".".join(str(p) for p in e["loc"][1:]), e["msg"]) for e in exc.errors()]
        messages = [f"{where or 'body'}: {what}" for where, what in said]
        return envelope(surface_status(request.url.path, 422), "; ".join(messages), said[0][0] or None,
                        "invalid_value")

    @app.exception_handler(SQLAlchemyTimeoutError)
    async def _busy(_: Request, exc: SQLAlchemyTimeoutError):
        log.warning("no database connection free: %s", exc)
        response = envelope(503, "the server is busy (no database connection free): retry shortly", None, "busy")
        response.headers["Retry-After"] = "2"
        return response

    app.add_middleware(UnexpectedErrors)  # the outermost of ours: it also sees the other middlewares' errors


class UnexpectedErrors:
    """A bug's 500 in the envelope, on a connection that stays open.

    Starlette's own catch-all answers and then re-raises, and uvicorn closes a connection whose app raised:
    every client of a keep-alive pool would pay a reconnect for one bad request."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:  # half an answer went out: only closing the connection tells the client
                raise
            log.exception("unhandled error")
            response = envelope(500, f"internal error ({type(exc).__name__}); the server log has the details")
            await response(scope, receive, send)
