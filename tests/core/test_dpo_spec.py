"""DPO in the spec: method.objective and method.dpo, dataset.format preference, the rule that ties the two (in
the model and, as CEL, in the CRD), the runtime's job config made from them, and where a cluster reads the
reference model."""

import pytest
from pydantic import ValidationError

from tunewright_core.crds import CEL_RULES, crds
from tunewright_core.jobconfig import runtime_config
from tunewright_core.plan_of_record import spec_hash
from tunewright_core.spec import FineTuneJobSpec, JobPlan, error_message
from tunewright_core.storage import PVC_ROOT, cluster_storage

SFT = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "dataset": {"train": "file-1"}}
DPO = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"objective": "dpo"},
       "dataset": {"train": "file-1", "format": "preference"}}
PLAN = JobPlan(pool="p", strategy="fsdp", workers=8, gpus=8, micro_batch=2, grad_accum=4, shard_group=8,
               explanation="test")


def messages(spec: dict) -> list[str]:
    errors = pytest.raises(ValidationError, FineTuneJobSpec.model_validate, spec).value.errors()
    return [error_message(e, FineTuneJobSpec) for e in errors]


def test_the_defaults_are_sft_and_dpos_own():
    sft, dpo = FineTuneJobSpec.model_validate(SFT), FineTuneJobSpec.model_validate(DPO)
    assert (sft.method.objective, sft.dataset.format) == ("sft", "chat")
    assert (dpo.method.type, dpo.method.objective, dpo.dataset.format) == ("lora", "dpo", "preference")
    assert (dpo.method.dpo.beta, dpo.method.dpo.label_smoothing, dpo.method.dpo.reference) == (0.1, 0.0, None)
    wire = dpo.model_dump(by_alias=True, exclude_none=True)
    assert wire["method"]["objective"] == "dpo" and wire["method"]["dpo"] == {"beta": 0.1, "labelSmoothing": 0.0}
    assert FineTuneJobSpec.model_validate(wire) == dpo


@pytest.mark.parametrize("method_type", ["lora", "full"])
def test_the_objective_is_orthogonal_to_lora_or_full(method_type):
    spec = FineTuneJobSpec.model_validate({**DPO, "method": {"type": method_type, "objective": "dpo"}})
    assert (spec.method.type, spec.method.objective) == (method_type, "dpo")


@pytest.mark.parametrize(("spec", "field", "fix"), [
    ({**SFT, "method": {"objective": "dpo"}}, "dataset.format",
     "set dataset.format to preference (not chat, the default where it is not given)"),
    ({**SFT, "method": {"objective": "dpo"}, "dataset": {"train": "f", "format": "prompt_completion"}},
     "dataset.format", "(not prompt_completion)"),
    ({**SFT, "dataset": {"train": "f", "format": "preference"}}, "method.objective",
     "set method.objective to dpo (not sft)"),
    ({**SFT, "method": {"objective": "sft"}, "dataset": {"train": "f", "format": "preference"}}, "method.objective",
     "set method.objective to dpo"),
])
def test_dpo_needs_preference_pairs_and_only_dpo_trains_on_them(spec, field, fix):
    (said,) = messages(spec)
    assert said.startswith(f"Value error, {field}: ") and fix in said


@pytest.mark.parametrize(("dpo", "field"), [
    ({"beta": 0}, "beta"), ({"beta": -1}, "beta"), ({"beta": 101}, "beta"),
    ({"labelSmoothing": 0.5}, "labelSmoothing"), ({"labelSmoothing": -0.1}, "labelSmoothing"),
    ({"reference": ""}, "reference"), ({"reference": "org/model\nrm"}, "reference"),
])
def test_dpos_settings_are_bounded(dpo, field):
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate({**DPO, "method": {"objective": "dpo", "dpo": dpo}})
    assert err.value.errors()[0]["loc"] == ("method", "dpo", field)


@pytest.mark.parametrize(("method", "said"), [
    ({"objective": "dpo", "dpo": {"betta": 0.2}}, "unknown key; did you mean beta?"),
    ({"objective": "dpo", "dpo": {"label_smooting": 0.1}}, "unknown key; did you mean labelSmoothing?"),
    ({"objectve": "dpo"}, "unknown key; did you mean objective?"),
])
def test_an_unknown_key_still_names_the_closest(method, said):
    assert said in messages({**DPO, "method": method})


def test_objective_must_be_sft_or_dpo():
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate({**DPO, "method": {"objective": "ppo"}})
    assert err.value.errors()[0]["loc"] == ("method", "objective")


def test_the_crd_says_the_rule_and_describes_the_fields():
    (crd,) = [c for c in crds().values() if c["spec"]["names"]["kind"] == "FineTuneJob"]
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = root["properties"]["spec"]
    assert spec["x-kubernetes-validations"] == CEL_RULES[()]
    rules = dpo_rules()
    assert len(rules) == 2
    assert [r["message"].split(":")[0] for r in rules] == ["dataset.format", "method.objective"]
    assert "x-kubernetes-validations" not in root["properties"]["status"]  # the spec's rules, not the status's
    method = spec["properties"]["method"]["properties"]
    assert method["objective"]["enum"] == ["sft", "dpo"] and method["objective"]["default"] == "sft"
    assert "Orthogonal to type" in method["objective"]["description"]
    dpo = method["dpo"]["properties"]
    assert (dpo["beta"]["default"], dpo["beta"]["minimum"], dpo["beta"]["exclusiveMinimum"]) == (0.1, 0, True)
    assert (dpo["labelSmoothing"]["maximum"], dpo["labelSmoothing"]["exclusiveMaximum"]) == (0.5, True)
    assert "preference" in spec["properties"]["dataset"]["properties"]["format"]["enum"]


def test_the_cel_rules_decide_as_the_model_does():
    """The two rules, read as the API server reads them (has() of an absent field is false), on the four
    combinations; a stand-in for CEL that knows only what these rules use."""
    def holds(rule: str, spec: dict) -> bool:
        objective = (spec.get("method") or {}).get("objective")
        fmt = spec["dataset"].get("format")
        dpo, pairs = objective == "dpo", fmt == "preference"
        expression = rule.replace(CEL_DPO, str(dpo)).replace(CEL_PAIRS, str(pairs)).replace("!", " not ")
        return eval(expression.replace("||", " or "))  # noqa: S307 (our own rule text)

    for objective, fmt in [("sft", "chat"), ("dpo", "preference"), ("dpo", "chat"), ("sft", "preference"),
                           (None, "chat"), (None, "preference")]:
        spec = {**SFT, "method": {"objective": objective} if objective else {}, "dataset": {"train": "f", "format": fmt}}
        model_accepts = True
        try:
            FineTuneJobSpec.model_validate(spec)
        except ValidationError:
            model_accepts = False
        assert all(holds(r["rule"], spec) for r in dpo_rules()) == model_accepts, (objective, fmt)


def dpo_rules() -> list[dict]:
    """The root rules that tie the objective to the format (the others span other fields)."""
    return [r for r in CEL_RULES[()] if CEL_DPO in r["rule"]]


CEL_DPO = "has(self.method) && has(self.method.objective) && self.method.objective == 'dpo'"
CEL_PAIRS = "has(self.dataset.format) && self.dataset.format == 'preference'"


def test_the_job_config_carries_the_objective_for_dpo_only():
    sft = runtime_config(FineTuneJobSpec.model_validate(SFT), PLAN, name="a", output_dir="/o", train="/t",
                         validation=None)
    assert "objective" not in sft["method"] and "dpo" not in sft["method"]  # sft: the config it always was
    spec = FineTuneJobSpec.model_validate({**DPO, "method": {"type": "full", "objective": "dpo", "dpo": {
        "beta": 0.25, "labelSmoothing": 0.1, "reference": "hf://org/sft-model"}}})
    dpo = runtime_config(spec, PLAN, name="a", output_dir="/o", train="/t", validation="/v")
    assert dpo["method"]["type"] == "full" and dpo["method"]["objective"] == "dpo"
    assert dpo["method"]["dpo"] == {"beta": 0.25, "label_smoothing": 0.1, "reference": "hf://org/sft-model"}
    assert dpo["dataset"]["format"] == "preference"
    moved = runtime_config(spec, PLAN, name="a", output_dir="/o", train="/t", validation=None,
                           reference="/mnt/pvc/models/sft")
    assert moved["method"]["dpo"]["reference"] == "/mnt/pvc/models/sft"
    plain = runtime_config(FineTuneJobSpec.model_validate(DPO), PLAN, name="a", output_dir="/o", train="/t",
                           validation=None)
    assert plain["method"]["dpo"] == {"beta": 0.1, "label_smoothing": 0.0, "reference": None}


def test_a_dpo_job_config_parses_with_the_runtimes_loader():
    config = pytest.importorskip("tunewright_jobs.config")
    if "objective" not in config.MethodConfig.model_fields:
        pytest.xfail("the runtime's job config does not take method.objective yet (jobs/tunewright_jobs/config.py)")
    spec = FineTuneJobSpec.model_validate({**DPO, "method": {"objective": "dpo", "dpo": {"beta": 0.3}}})
    cfg = config.JobConfig.from_dict(runtime_config(spec, PLAN, name="a", output_dir="/o", train="/t",
                                                    validation=None))
    assert (cfg.method.objective, cfg.method.dpo.beta, cfg.dataset.format) == ("dpo", 0.3, "preference")


UPLOADED = "file-" + "0" * 24


def test_a_cluster_mounts_the_volume_a_reference_is_on():
    spec = FineTuneJobSpec.model_validate({**DPO, "method": {"objective": "dpo", "dpo": {
        "reference": "pvc://models/sft-run/export"}}, "dataset": {"train": UPLOADED, "format": "preference"},
        "checkpoint": {"storage": "pvc://checkpoints/x"}})
    storage = cluster_storage(spec)
    assert storage.reference == f"{PVC_ROOT}/models/sft-run/export"
    assert "models" in storage.volumes.claims and "models" not in storage.volumes.writable
    hub = FineTuneJobSpec.model_validate({**DPO, "method": {"objective": "dpo", "dpo": {"reference": "org/sft"}},
                                          "dataset": {"train": UPLOADED, "format": "preference"},
                                          "checkpoint": {"storage": "pvc://checkpoints/x"}})
    assert cluster_storage(hub).reference == "org/sft"
    sft = FineTuneJobSpec.model_validate({**SFT, "method": {"dpo": {"reference": "pvc://models/ignored"}},
                                          "dataset": {"train": UPLOADED}, "checkpoint": {"storage": "pvc://checkpoints/x"}})
    assert cluster_storage(sft).reference is None and "models" not in cluster_storage(sft).volumes.claims


def test_an_sft_specs_hash_leaves_out_what_dpo_added():
    """So a job that ran before dpo existed is not taken for a changed one after the upgrade."""
    sft = FineTuneJobSpec.model_validate(SFT)
    assert spec_hash(sft) == spec_hash(FineTuneJobSpec.model_validate({**SFT, "method": {"dpo": {"beta": 0.5}}}))
    dpo = FineTuneJobSpec.model_validate(DPO)
    assert spec_hash(dpo) != spec_hash(FineTuneJobSpec.model_validate({**DPO, "method": {
        "objective": "dpo", "dpo": {"beta": 0.5}}}))
