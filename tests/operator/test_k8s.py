"""The operator's Kubernetes calls, over real HTTP to a small recording server: paths, verbs, content types,
and what a 409 or a 404 becomes."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from tunewright_core.k8s import AlreadyExists, KubernetesCluster, KubernetesError


class Recorder(BaseHTTPRequestHandler):
    requests: list = []
    answers: dict = {}  # (method, path without query) -> (status, body)

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = self.path.split("?")[0]
        Recorder.requests.append((self.command, self.path, self.headers.get("Content-Type"), body))
        status, answer = Recorder.answers.get((self.command, path), (404, {"kind": "Status", "code": 404}))
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _answer  # noqa: N815 (http.server's names)

    def log_message(self, *args):
        pass


@pytest.fixture
def cluster():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Recorder.requests, Recorder.answers = [], {}
    configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    yield KubernetesCluster(client.ApiClient(configuration))
    server.shutdown()


def test_reads_and_lists_by_kind_with_selectors(cluster):
    job_path = "/apis/tunewright.dev/v1alpha1/namespaces/team-a/finetunejobs/llama"
    Recorder.answers[("GET", job_path)] = (200, {"kind": "FineTuneJob", "metadata": {"name": "llama"}})
    Recorder.answers[("GET", "/api/v1/nodes")] = (200, {"items": [{"metadata": {"name": "gpu-1"}}]})
    assert cluster.get("FineTuneJob", "team-a", "llama")["metadata"]["name"] == "llama"
    assert cluster.get("RayJob", "team-a", "gone") is None  # 404: gone, not an error
    assert [n["metadata"]["name"] for n in cluster.list("Node", None, "pool=h100")] == ["gpu-1"]
    assert Recorder.requests[-1][1] == "/api/v1/nodes?labelSelector=pool%3Dh100"


def test_writes_use_the_right_verbs_paths_and_patch_type(cluster):
    Recorder.answers[("POST", "/apis/ray.io/v1/namespaces/team-a/rayjobs")] = (201, {"kind": "RayJob"})
    Recorder.answers[("PATCH", "/apis/tunewright.dev/v1alpha1/gpupools/h100/status")] = (200, {})
    Recorder.answers[("POST", "/api/v1/namespaces/team-a/events")] = (201, {})
    assert cluster.create({"kind": "RayJob", "metadata": {"name": "r", "namespace": "team-a"}}) == {"kind": "RayJob"}
    cluster.patch_status("GPUPool", None, "h100", {"nodes": 2})
    assert Recorder.requests[-1][1:] == ("/apis/tunewright.dev/v1alpha1/gpupools/h100/status",
                                        "application/merge-patch+json", {"status": {"nodes": 2}})
    cluster.event({"kind": "FineTuneJob", "metadata": {"name": "llama", "namespace": "team-a", "uid": "u"}},
                  "Warning", "Unschedulable", "0/8 nodes")
    event = Recorder.requests[-1][3]
    assert event["metadata"]["generateName"] == "llama." and event["involvedObject"]["uid"] == "u"
    cluster.delete("Secret", "team-a", "already-gone")  # 404 on delete is fine


def test_a_conflict_on_create_means_it_exists_and_other_errors_are_raised(cluster):
    Recorder.answers[("POST", "/api/v1/namespaces/team-a/secrets")] = (409, {"reason": "AlreadyExists"})
    Recorder.answers[("POST", "/api/v1/namespaces/team-a/configmaps")] = (422, {"reason": "Invalid"})
    with pytest.raises(AlreadyExists):
        cluster.create({"kind": "Secret", "metadata": {"name": "s", "namespace": "team-a"}})
    with pytest.raises(KubernetesError, match="422"):
        cluster.create({"kind": "ConfigMap", "metadata": {"name": "c", "namespace": "team-a"}})
