"""Every request body is bounded before and while it is read, and credentials are checked before a body is
read at all (issue 15, item 5's last part and "limits everywhere")."""

import json
import socket
import time

import httpx
import pytest

from tests.api.conftest import Server


@pytest.fixture
def small_server(tmp_path):
    with Server(tmp_path / "data", local_ray=False, max_upload_bytes=1 << 20) as s:
        yield s


def raw_request(server, head: str, body: bytes = b"", wait: float = 5.0) -> str:
    """Send a request's head (and part of a body) on a raw socket; the answer that comes within `wait` s."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as conn:
        conn.sendall(head.encode() + b"\r\n\r\n" + body)
        started, answer = time.monotonic(), b""
        while time.monotonic() - started < wait and b"\r\n\r\n" not in answer:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
        return answer.decode(errors="replace")


def test_an_unauthenticated_body_is_refused_before_it_is_sent(small_server):
    """The head claims 200 MB and no token: 401 at once, without waiting for (or reading) a byte of it."""
    answer = raw_request(small_server, "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                                       "boundary=b\r\nContent-Length: 1048576")
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    answer = raw_request(small_server, "POST /v1/internal/jobs/ftjob-x/telemetry HTTP/1.1\r\nHost: x\r\n"
                                       "Authorization: Bearer forged\r\nContent-Type: application/json\r\n"
                                       "Content-Length: 1000000")
    assert answer.startswith("HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize(("path", "size"), [("/v1/jobs", 2 << 20), ("/v1/files", 3 << 20), ("/v1/plans", 2 << 20)])
def test_a_declared_length_over_the_routes_limit_is_refused_before_it_is_read(small_server, path, size):
    token = small_server.tenant("alice").headers["Authorization"]
    answer = raw_request(small_server, f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n"
                                       f"Content-Type: application/json\r\nContent-Length: {size}")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split("\r\n\r\n", 1)[1] or "{}").get("error", {}).get("code") in ("too_large", None)


def test_a_streamed_upload_is_refused_when_it_passes_the_limit(small_server):
    """Chunked (no length to check first): refused as it passes 1 MiB, and nothing of it stays on disk."""
    alice = small_server.tenant("alice")
    line = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})

    def body():
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        for _ in range(4 * 2**20 // len(line)):
            yield (line + "\n").encode()
        yield b"\r\n--b--\r\n"

    try:
        response = alice.post("/v1/files", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b"})
        assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    except (httpx.WriteError, httpx.RemoteProtocolError):
        pass  # the server answered and closed while the client was still sending: refused all the same
    assert [p for p in (small_server.settings.data_dir / "files").rglob("*") if p.is_file()] == []
    assert alice.get("/v1/files").json()["data"] == []


def test_bodies_within_the_limits_still_pass(small_server):
    alice = small_server.tenant("alice")
    answer = alice.post("/v1/plans", json={"spec": {}, "pool": "none"})
    assert answer.status_code == 422  # read and judged on its content, not refused for its size
