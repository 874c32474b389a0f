"""The operator's one call to the tunewright API: a job's summary (progress, measured telemetry), read with
the job's own token, for the FineTuneJob's status. The API being unreachable never fails a reconcile."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

from tunewright_operator.manifests import ClusterSettings, Target, internal_url

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 2.0
# after a failure, reconciles go on without asking for a while: a down API must not stall every job's lock
BACK_OFF_SECONDS = 30.0
MAX_SUMMARY_BYTES = 1 << 20


class ApiSummaries:
    def __init__(self, settings: ClusterSettings):
        self.settings = settings
        self._quiet_until = 0.0

    def __call__(self, target: Target, token: str) -> dict | None:
        if time.monotonic() < self._quiet_until:
            return None
        request = urllib.request.Request(internal_url(self.settings, target, "summary"),
                                         headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                return json.loads(response.read(MAX_SUMMARY_BYTES))
        except (OSError, ValueError) as err:  # unreachable, refused, not JSON: the status keeps what it had
            log.info("no summary of job %s from the API (asking again in %.0f s): %s", target.job_id,
                     BACK_OFF_SECONDS, err)
            if not isinstance(err, urllib.error.HTTPError):  # the API answered: only this job has nothing
                self._quiet_until = time.monotonic() + BACK_OFF_SECONDS
            return None
