"""The records the runtime emits (`tunewright_core.records`) are accepted by the API's own models
(`tunewright_api.telemetry`), sent the way the runtime's HTTP sink sends them."""

import json
import math

import pytest
from pydantic import BaseModel

from tests.jobs.conftest import make_config
from tests.jobs.test_metrics import ONE_OF_EACH, STEP
from tunewright_api import telemetry as api
from tunewright_core import records as runtime
from tunewright_jobs.run import train_without_ray

PAIRS = [(runtime.StartRecord, api.StartRecord), (runtime.StepRecord, api.StepRecord),
         (runtime.EvalRecord, api.EvalRecord), (runtime.CommRecord, api.CommRecord),
         (runtime.CheckpointRecord, api.CheckpointRecord), (runtime.EndRecord, api.EndRecord)]


def as_posted(records: list[BaseModel]) -> list:
    """Serialized as HttpSink posts them, parsed as the API's endpoint parses them; all must be accepted."""
    body = json.dumps({"records": [r.model_dump(mode="json") for r in records]})
    accepted, rejected = api.parse_records(api.TelemetryBatch.model_validate(json.loads(body)).records)
    assert rejected == []
    return accepted


def test_every_record_kind_is_accepted_with_its_meaning():
    accepted = as_posted(ONE_OF_EACH)
    assert [type(r).__name__ for r in accepted] == [type(r).__name__ for r in ONE_OF_EACH]
    for sent, got in zip(ONE_OF_EACH, accepted, strict=True):
        for field in type(got).model_fields:
            if field in type(sent).model_fields and field != "export":
                assert getattr(got, field) == getattr(sent, field), (type(sent).__name__, field)


@pytest.mark.parametrize(("runtime_model", "api_model"), PAIRS)
def test_what_the_api_requires_the_runtime_always_sends(runtime_model, api_model):
    assert runtime_model.model_fields["event"].default == api_model.model_fields["event"].annotation.__args__[0]
    required = {name for name, field in api_model.model_fields.items() if field.is_required()}
    assert required <= set(runtime_model.model_fields), required - set(runtime_model.model_fields)


def test_a_diverged_loss_is_accepted_as_unknown():
    (step,) = as_posted([STEP.model_copy(update={"loss": math.nan, "grad_norm": math.inf})])
    assert step.loss is None and step.grad_norm is None and step.tokens == STEP.tokens


@pytest.mark.slow  # trains a tiny run (10-20 s here)
def test_a_real_run_s_records_are_all_accepted(tiny_models, tmp_path):
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 4},
                      checkpoint={"every_steps": 2}, eval={"exact_match": True, "max_batches": 1})
    train_without_ray(cfg)
    emitted = runtime.read_records(cfg.metrics_path)
    accepted = as_posted(emitted)
    assert {r.event for r in accepted} == {"start", "eval", "step", "comm", "checkpoint", "end"}
    assert [r.step for r in accepted if r.event == "checkpoint"] == [2, 4]


def test_a_refused_record_costs_only_itself():
    good = STEP.model_dump(mode="json")
    accepted, rejected = api.parse_records([good, {**good, "step": -1}, {"event": "gossip", "step": 1}, good])
    assert len(accepted) == 2 and [r.index for r in rejected] == [1, 2]
    assert rejected[0].error.startswith("step.step") or "step" in rejected[0].error
