"""The CRDs are generated from spec.py, are valid structural CustomResourceDefinitions, agree with the
typed models on what they accept, and take every status the operator writes without pruning any of it."""

import copy
from datetime import UTC, datetime
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from tests.support.schemas import errors, structural_violations
from tunewright_core.crds import (
    DEFAULT_OUT,
    SCHEMA_DIGEST,
    crds,
    incompatible_crds,
    missing_crds,
    render,
    schema_digest,
    schema_gaps,
)
from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import LINKS, Pool
from tunewright_core.planner.jobs import plan_job
from tunewright_core.planner.models import CATALOG
from tunewright_core.spec import (
    Condition,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPoolSpec,
    GPUPoolStatus,
    JobProgress,
    JobTelemetry,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")  # the oldest and newest the chart claims
SPEC_MODELS = {"FineTuneJob": FineTuneJobSpec, "GPUPool": GPUPoolSpec}


def schema_of(kind: str) -> dict:
    (crd,) = [c for c in crds().values() if c["spec"]["names"]["kind"] == kind]
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_committed_crds_are_the_generated_ones():
    for name, crd in crds().items():
        committed = DEFAULT_OUT / name
        assert committed.is_file() and committed.read_text() == render(crd), (
            f"{committed} drifted from spec.py: run `python -m tunewright_core.crds`")
    assert sorted(p.name for p in DEFAULT_OUT.glob("*.yaml")) == sorted(crds())


def test_each_crd_carries_the_digest_of_its_spec_and_any_change_changes_it():
    for crd in crds().values():
        assert crd["metadata"]["annotations"][SCHEMA_DIGEST] == schema_digest(crd["spec"])
        described = yaml.safe_load(yaml.safe_dump(crd["spec"]))
        described["versions"][0]["schema"]["openAPIV3Schema"]["description"] += "."
        assert schema_digest(described) != schema_digest(crd["spec"])
    assert len({crd["metadata"]["annotations"][SCHEMA_DIGEST] for crd in crds().values()}) == len(crds())


def _installed(digest: str | None, **status_changes) -> list[dict]:
    """Our CRDs as a cluster holds them, the GPUPool's with `digest` (None: a chart from before digests) and
    its status schema's properties changed (None removes one)."""
    jobs, pools = copy.deepcopy(list(crds().values()))
    pools["metadata"]["annotations"] = {SCHEMA_DIGEST: digest} if digest else {}
    status = pools["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for name, schema in status_changes.items():
        if schema is None:
            del status[name]
        else:
            status[name] = schema
    return [jobs, pools]


POOLS_DIGEST = crds()["tunewright.dev_gpupools.yaml"]["metadata"]["annotations"][SCHEMA_DIGEST]
EFFICIENCY = "measuredEfficiency"


@pytest.mark.parametrize(("installed", "wrong"), [
    (_installed(POOLS_DIGEST), []),
    (_installed(None), []),  # no digest, the same fields: it takes what this release writes
    (_installed("sha256:0123456789abcdef", zone={"type": "string"}), []),  # a later release's, one field more
    (_installed(None, **{EFFICIENCY: None}), [".status.measuredEfficiency: missing"]),
    (_installed(None, nodes={"type": "string"}), [".status.nodes: type string, not integer"]),
    (_installed(None, disagreements={"type": "array"}), [".status.disagreements[]: missing"]),
    (_installed(None, **{EFFICIENCY: {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}), []),
])
def test_crds_that_would_refuse_or_prune_what_this_release_writes_are_named_with_their_fields(installed, wrong):
    found = incompatible_crds(installed)
    if not wrong:
        assert found == [] and missing_crds(installed) == []
        return
    (sentence,) = found
    assert sentence == ("gpupools.tunewright.dev is another release's and would refuse or prune what this one writes "
                        f"({'; '.join(wrong)})")


def test_schema_gaps_reads_enumerations_and_maps():
    ours = {"type": "object", "properties": {"phase": {"type": "string", "enum": ["a", "b"]},
                                             "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}
    assert schema_gaps(ours, ours) == []
    narrower = copy.deepcopy(ours)
    narrower["properties"]["phase"]["enum"] = ["a"]
    narrower["properties"]["labels"]["additionalProperties"] = {"type": "integer"}
    assert schema_gaps(ours, narrower) == [".phase: allows only a", ".labels.*: type integer, not string"]
    assert missing_crds(_installed(POOLS_DIGEST)[1:]) == ["finetunejobs.tunewright.dev"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(crds()))
def test_crds_are_valid_custom_resource_definitions(name, version):
    kubernetes_validate.validate(crds()[name], version, strict=True)
    assert structural_violations(crds()[name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]) == []


def test_every_spec_field_is_described_for_kubectl_explain():
    def undescribed(node, path):
        missing = [] if "description" in node else [path]
        for name, sub in node.get("properties", {}).items():
            missing += undescribed(sub, f"{path}.{name}")
        return missing

    for kind in SPEC_MODELS:
        assert undescribed(schema_of(kind)["properties"]["spec"], f"{kind}.spec") == []


def test_finetunejob_crd_has_what_kubectl_and_kopf_need():
    (crd,) = [c for c in crds().values() if c["spec"]["names"]["kind"] == "FineTuneJob"]
    names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
    assert names["shortNames"] == ["ftj"] and names["categories"] == ["tunewright"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert columns == ["Phase", "Strategy", "GPUs", "Progress", "MFU", "Comm", "Cost", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"]
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["hyperparameters"][
        "x-kubernetes-validations"]
    assert any("globalBatchTokens % self.seqLen" in r["rule"] for r in rules)


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_examples_are_accepted_by_the_crds_and_the_models(path):
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == "tunewright.dev/v1alpha1"
    assert errors(schema_of(manifest["kind"]), manifest) == []
    SPEC_MODELS[manifest["kind"]].model_validate(manifest["spec"])


JOB = yaml.safe_load((EXAMPLES / "cluster" / "finetunejob-lora.yaml").read_text())


@pytest.mark.parametrize(("section", "patch"), [
    ("hyperparameters", {"seqLen": 0}),
    ("hyperparameters", {"warmupRatio": 1.0}),
    ("hyperparameters", {"learningRate": "fast"}),
    ("resources", {"strategy": "tensor-parallel"}),
    ("resources", {"maxGPUs": 0}),
    ("resources", {"replicas": 2}),  # misspelt or unknown: pruned by a real API server, refused here
    ("method", {"type": "qlora"}),
    ("dataset", {"format": "csv"}),
])
def test_the_crd_and_the_model_refuse_the_same_specs(section, patch):
    spec = {**JOB["spec"], section: {**JOB["spec"][section], **patch}}
    assert errors(schema_of("FineTuneJob"), {**JOB, "spec": spec}) != []
    with pytest.raises(ValidationError):
        FineTuneJobSpec.model_validate(spec)


def test_every_status_the_operator_writes_is_kept_whole():
    spec = FineTuneJobSpec.model_validate(JOB["spec"])
    cal, h200 = calibration.load()
    plan = plan_job(spec, Pool("h200", h200, 8, 2, LINKS["nvlink4"], LINKS["ib-8x400g"], 3.5), cal,
                    CATALOG["meta-llama/Llama-3.1-8B"], dataset_tokens=10**8)
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    status = FineTuneJobStatus(
        phase="Running", observed_generation=2, plan=plan, ray_job_name="llama-8b-support-lora-x7k2",
        dashboard_url="http://llama-8b-support-lora-x7k2-head-svc:8265", start_time=now,
        conditions=[Condition(type="Planned", status="True", observed_generation=2, last_transition_time=now,
                              reason="Planned", message=plan.explanation)],
        progress=JobProgress(step=10, total_steps=100, percent=10.0, loss=1.2, tokens_per_second=9e4,
                             trained_tokens=10**6, eta_seconds=600.0),
        telemetry=JobTelemetry(comm_share=0.1, comm_share_exposed=0.01, mfu=0.4, cost_usd=3.2))
    written = {**JOB, "status": status.model_dump(by_alias=True, mode="json", exclude_none=True)}
    assert errors(schema_of("FineTuneJob"), written) == []
    pool = yaml.safe_load((EXAMPLES / "cluster" / "gpupool-h100.yaml").read_text())
    pool["status"] = GPUPoolStatus(nodes=4, allocatable_gpus=32, gpu_products=["NVIDIA-H100-80GB-HBM3"],
                                   gpu_memory_mib=81559).model_dump(by_alias=True, mode="json", exclude_none=True)
    assert errors(schema_of("GPUPool"), pool) == []
