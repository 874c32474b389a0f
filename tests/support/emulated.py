"""The real operator (`kopf run`, as the chart runs it) against the emulated API server (apiserver.py).

The test plays KubeRay: it writes the RayJob's status the way KubeRay would, and the operator's
reaction is read back through the API, as a user's kubectl would see it.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from kubernetes import client

from tests.support.apiserver import KUBERAY_RAYJOB_CRD, FakeApiServer, Resource, crd_document, load_crd
from tunewright_core.k8s import KubernetesCluster

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "tunewright" / "crds"


@cache
def resources() -> tuple[Resource, ...]:
    found = [r for path in sorted(CRDS.glob("*.yaml")) for r in load_crd(path)]
    return (*found, *load_crd(KUBERAY_RAYJOB_CRD, {"v1"}))


def crds_installed() -> FakeApiServer:
    """The emulated API server of a cluster where tunewright's CRDs were installed (the committed ones, as
    the chart installs them) and KubeRay's RayJob is served (its CRD object not stored: nothing reads it)."""
    return FakeApiServer(list(resources()), installed=[crd_document(path) for path in sorted(CRDS.glob("*.yaml"))])


def client_for(server: FakeApiServer) -> KubernetesCluster:
    api = client.ApiClient(client.Configuration(host=server.url))
    api.user_agent = FakeApiServer.TEST_AGENT  # the emulator counts only the operator's writes
    return KubernetesCluster(api, component="tests")


class Operator:
    """`kopf run` in a subprocess, started and stopped (or killed) by the test."""

    COMMAND = ("kopf", "run", "--standalone", "--all-namespaces", "--verbose", "-m", "tunewright_operator.handlers")

    def __init__(self, kubeconfig: Path, log: Path, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = COMMAND):
        self.kubeconfig, self.log, self.env, self.command = kubeconfig, log, env or {}, command
        self.process: subprocess.Popen | None = None

    def start(self) -> Operator:
        # the key the chart makes in production; a test's own env (the chart's, say) takes precedence
        env = {**os.environ, "TUNEWRIGHT_JOB_TOKEN_KEY": "test-job-token-key-" + "0" * 16, **self.env,
               "KUBECONFIG": str(self.kubeconfig)}
        assert self.command[0] == "kopf", self.command
        self.process = subprocess.Popen([sys.executable, "-m", *self.command], env=env, stdout=self.log.open("a"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def wait_for(check, timeout: float = 30.0, what: str = "the condition", operator: Operator | None = None):
    """Poll `check` until it returns something truthy; fail naming what was awaited and the operator's log."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                 + (operator.tail() if operator else ""))
        time.sleep(0.2)


def secret_token(secret: dict) -> str:
    """A job's token as the operator wrote it (stringData) or as the API server returns it (base64 data)."""
    if "stringData" in secret:
        return secret["stringData"]["token"]
    return base64.b64decode(secret["data"]["token"]).decode()
