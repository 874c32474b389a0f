"""OpenAPI links: from a created resource to the operations that take its id.

Clients that read links (and schemathesis' stateful tests) follow them: create a job, then get, cancel or page
through it with the id the answer gave."""

from __future__ import annotations


def operation_ref(method: str, path: str) -> str:
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


def links_from(status: int, field: str, param: str, *operations: tuple[str, str]) -> dict:
    """`responses=` for a route whose `status` answer holds the new resource's `field`; each (method, path)
    takes it as `param`."""
    def name(method: str, path: str) -> str:
        last = path.rstrip("/").rsplit("/", 1)[-1]
        return method.title() + ("" if last.startswith("{") else last.title().replace("_", ""))

    return {status: {"links": {name(m, p): {"operationRef": operation_ref(m, p),
                                            "parameters": {param: f"$response.body#/{field}"}}
                               for m, p in operations}}}
