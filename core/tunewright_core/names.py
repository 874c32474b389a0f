"""The names, labels and annotations tunewright puts on cluster objects: what the API writes, the operator
reads (and the other way round), in one place."""

from __future__ import annotations

import hashlib

API_VERSION = "tunewright.dev/v1alpha1"
TENANT_LABEL = "tunewright.dev/tenant"  # on a tenant's namespace: the tenant whose jobs it holds
JOB_LABEL = "tunewright.dev/run"  # on everything made for a job: its RayJob's name
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_ID_ANNOTATION = "tunewright.dev/job-id"  # the API's id for the job, set by the API when it creates the job
DATASET_BYTES_ANNOTATION = "tunewright.dev/dataset-bytes"  # the training file's size, when the API knows it
TOKEN_HASH_ANNOTATION = "tunewright.dev/telemetry-token-sha256"
MODEL_SHAPE_ANNOTATION = "tunewright.dev/model-shape"  # config.json's shape keys, for a model not in the catalog
PLAN_ANNOTATION = "tunewright.dev/plan"  # the API's plan of record, for the spec and pool it was made on
SPEC_HASH_ANNOTATION = "tunewright.dev/spec-sha256"  # on a RayJob: the spec it was made from


def job_id_of(meta: dict) -> str:
    """The API's id for a FineTuneJob: the one the API annotated, else one derived from the uid, so a job
    made with kubectl has the same id in the operator (telemetry URLs) and the API (its job list)."""
    return meta.get("annotations", {}).get(JOB_ID_ANNOTATION) or f"ftjob-{meta['uid'].replace('-', '')[:24]}"


def short_hash(text: str, length: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]
