"""Lighter optimizer state in the spec and the plan: hyperparameters.optimizerState (fp32, bf16, auto) from the
spec (and, as CEL, the CRD) through the planner's choice to the runtime's job config, and the plan of record held
to it. An 8B full fine-tune on one H200 fits with bf16 weights and moments, not with fp32 masters."""

import pytest
from pydantic import ValidationError

from tunewright_core.crds import finetunejob_crd
from tunewright_core.jobconfig import runtime_config
from tunewright_core.plan_of_record import spec_hash
from tunewright_core.planner import calibration
from tunewright_core.planner.band import band
from tunewright_core.planner.estimate import GRADIENTS, Layout, Workload, estimate, sharded_states
from tunewright_core.planner.hardware import LINKS, Pool
from tunewright_core.planner.jobs import plan_job
from tunewright_core.planner.models import CATALOG
from tunewright_core.spec import FineTuneJobSpec
from tunewright_jobs.config import JobConfig

CAL, H200 = calibration.load()
LLAMA_8B = CATALOG["meta-llama/Llama-3.1-8B"]
ONE_H200 = Pool("h200", H200, 1, 1, LINKS["nvlink4"], None, 3.5, host_memory_gib=2048)


def spec(state: str | None = None, method_type: str = "full") -> FineTuneJobSpec:
    hp = {"maxSteps": 100, "seqLen": 2048, "globalBatchSize": 16, **({"optimizerState": state} if state else {})}
    return FineTuneJobSpec.model_validate({"model": {"source": "m"}, "method": {"type": method_type},
                                           "dataset": {"train": "file-1"}, "hyperparameters": hp})


def test_bf16_state_halves_the_bytes_a_parameter_holds():
    """16 bytes a parameter with fp32 masters (weights, two moments, the gradient), 8 with bf16."""
    fp32, bf16 = (Workload(LLAMA_8B, "full", 2048, 16, 1, optimizer_state=s) for s in ("fp32", "bf16"))
    layout = Layout("single", 1, 1, 1, 1, True)
    held = {w.optimizer_state: sum(sharded_states(w, layout).values()) for w in (fp32, bf16)}
    assert held == {"fp32": 12 * LLAMA_8B.params, "bf16": 6 * LLAMA_8B.params}
    ends = {w.optimizer_state: estimate(w, layout, ONE_H200, CAL).memory_breakdown for w in (fp32, bf16)}
    assert ends["bf16"][GRADIENTS] * 2 == ends["fp32"][GRADIENTS] == 4 * LLAMA_8B.params
    # single computes on the bf16 weights in place: no copy of the blocks
    assert "unsharded blocks" not in estimate(bf16, layout, ONE_H200, CAL).memory_breakdown


def test_an_8b_full_fine_tune_fits_one_h200_with_bf16_state_and_auto_chooses_it_over_offload():
    fp32 = plan_job(spec("fp32"), ONE_H200, CAL, LLAMA_8B)
    assert fp32.cpu_offload and fp32.optimizer_state == "fp32"
    auto = plan_job(spec("auto"), ONE_H200, CAL, LLAMA_8B)
    assert (auto.optimizer_state, auto.cpu_offload, auto.strategy) == ("bf16", False, "single")
    assert auto.predicted.step_seconds < fp32.predicted.step_seconds / 2
    assert "optimizerState auto chose bf16: fp32 master weights fit only with CPU offload" in auto.explanation
    # measured on one H200 (light_state_check: 8B and 1B within 3%): no wider band there; several GPUs' sharded
    # step is counted only
    assert "bf16 weights and moments" not in auto.explanation
    several = band(calibration.evidence(), "H200", 8, None, 2048, "full", optimizer_state="bf16")
    assert "bf16 weights and moments on several GPUs (their sharded step counted, not measured)" in several.basis
    assert several.high / several.low > band(calibration.evidence(), "H200", 8, None, 2048, "full").high / \
        band(calibration.evidence(), "H200", 8, None, 2048, "full").low
    assert plan_job(spec("bf16"), ONE_H200, CAL, LLAMA_8B).optimizer_state == "bf16"


def test_auto_keeps_fp32_masters_where_they_fit():
    small = plan_job(spec("auto"), ONE_H200, CAL, CATALOG["meta-llama/Llama-3.2-1B"])
    assert small.optimizer_state == "fp32" and not small.cpu_offload


def test_bf16_state_is_for_full_fine_tuning():
    with pytest.raises(ValidationError, match="optimizerState: bf16 is for full fine-tuning"):
        spec("bf16", method_type="lora")
    assert spec("auto", method_type="lora").hyperparameters.optimizer_state == "auto"  # auto: fp32 for LoRA
    rules = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    assert any("optimizerState: bf16 is for full fine-tuning" in r["message"] for r in rules)


def test_the_plan_carries_the_state_into_the_runtime_config_and_fp32_leaves_it_as_it_was():
    auto = plan_job(spec("auto"), ONE_H200, CAL, LLAMA_8B)
    emitted = runtime_config(spec("auto"), auto, name="f", output_dir="/o", train="/t", validation=None)
    assert JobConfig.from_dict(emitted).hyperparameters.optimizer_state == "bf16"
    fp32 = plan_job(spec(), ONE_H200, CAL, LLAMA_8B)
    assert "optimizer_state" not in runtime_config(spec(), fp32, name="f", output_dir="/o", train="/t",
                                                   validation=None)["hyperparameters"]
    assert spec_hash(spec()) == spec_hash(FineTuneJobSpec.model_validate(spec().model_dump(by_alias=True)))
    assert spec_hash(spec("bf16")) != spec_hash(spec())


CEL_BF16 = ("has(self.hyperparameters) && has(self.hyperparameters.optimizerState) && "
            "self.hyperparameters.optimizerState == 'bf16'")
CEL_FULL = "has(self.method) && has(self.method.type) && self.method.type == 'full'"


@pytest.mark.parametrize("state", [None, "fp32", "bf16", "auto"])
@pytest.mark.parametrize("method_type", [None, "lora", "full"])
def test_the_cel_rule_decides_as_the_model_does(state, method_type):
    """Read as the API server reads it (has() of an absent field is false; method.type's default is lora)."""
    (rule,) = [r["rule"] for r in finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["x-kubernetes-validations"] if CEL_BF16 in r["rule"]]
    expression = rule.replace(CEL_BF16, str(state == "bf16")).replace(CEL_FULL, str(method_type == "full"))
    cel_accepts = eval(expression.replace("!", " not ").replace("||", " or "))  # noqa: S307 (our own rule text)
    body = {"model": {"source": "m"}, "dataset": {"train": "f"},
            "method": {"type": method_type} if method_type else {},
            "hyperparameters": {"optimizerState": state} if state else {}}
    try:
        FineTuneJobSpec.model_validate(body)
        model_accepts = True
    except ValidationError:
        model_accepts = False
    assert cel_accepts == model_accepts


def test_auto_keeps_fp32_masters_where_bf16_state_would_be_offloaded_too():
    """Llama-70B full on one H200: both need CPU offload, so bf16's quality cost would buy nothing."""
    plan = plan_job(spec("auto"), ONE_H200, CAL, CATALOG["meta-llama/Llama-3.1-70B"])
    assert plan.optimizer_state == "fp32" and plan.cpu_offload
    assert plan.explanation.endswith("auto kept the usual precision: bf16 weights and moments would need CPU "
                                     "offload too.")
