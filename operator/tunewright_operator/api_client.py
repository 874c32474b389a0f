"""The operator's one call to the tunewright API: a job's summary (progress, measured telemetry), read with
the job's own token, for the FineTuneJob's status. The API being unreachable never fails a reconcile."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from tunewright_operator.manifests import ClusterSettings, Target, internal_url

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 5.0
MAX_SUMMARY_BYTES = 1 << 20


class ApiSummaries:
    def __init__(self, settings: ClusterSettings):
        self.settings = settings

    def __call__(self, target: Target, token: str) -> dict | None:
        request = urllib.request.Request(internal_url(self.settings, target, "summary"),
                                         headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                return json.loads(response.read(MAX_SUMMARY_BYTES))
        except (OSError, ValueError) as err:  # unreachable, refused, not JSON: the status keeps what it had
            log.info("no summary of job %s from the API: %s", target.job_id, err)
            return None
