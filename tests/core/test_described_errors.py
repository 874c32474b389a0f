"""Validation errors as a person reads them: one per field, placed at the field a rule names, a union's kinds
said together, bounds and default given, an unknown key's did-you-mean."""

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunewright_core.spec import FineTuneJobSpec, described_errors

SPEC = {"model": {"source": "/models/tiny"}, "dataset": {"train": "file-1"}}


def said(changes: dict) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as refused:
        FineTuneJobSpec.model_validate({**SPEC, **changes})
    return described_errors(refused.value.errors(), FineTuneJobSpec)


@pytest.mark.parametrize(("changes", "expected"), [
    ({"method": {"lora": {"r": 0}}},
     [("method.lora.r", "Input should be greater than 0 (allowed: more than 0, at most 4096; default 16)")]),
    ({"method": {"objective": "dpo", "dpo": {"beta": 200}}},
     [("method.dpo.beta", "Input should be less than or equal to 100 (allowed: more than 0, at most 100; "
                          "default 0.1)")]),
    ({"method": {"objective": "dpo"}},  # a rule over fields, placed at the one it names; "Value error, " gone
     [("dataset.format", "method.objective dpo trains on preference pairs: set dataset.format to preference (not "
                         "chat, the default where it is not given)")]),
    ({"hyperparameters": {"learningRte": 1e-4}}, [("hyperparameters.learningRte", "unknown key; did you mean "
                                                                                  "learningRate?")]),
    ({"hyperparameters": {"epochs": 0, "learningRate": 2}},
     [("hyperparameters.epochs", "Input should be greater than 0 (allowed: more than 0, at most 1000; default 1)"),
      ("hyperparameters.learningRate", "Input should be less than or equal to 1 (allowed: more than 0, at most 1; "
                                       "default 0.0002)")]),
])
def test_each_refused_field_is_said_once_where_it_was_written(changes, expected):
    assert said(changes) == expected


class Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: Annotated[float, Field(gt=0, le=100)] | Literal["auto"] = "auto"
    labels: dict[str, int] = {}


class Outer(BaseModel):
    knobs: Knobs | None = None


@pytest.mark.parametrize(("given", "expected"), [
    ({"knobs": {"beta": 0}},  # one error for the two kinds it could have been, pydantic's kind names left out
     [("knobs.beta", "Input should be greater than 0 or 'auto' (allowed: more than 0, at most 100; default auto)")]),
    ({"knobs": {"labels": {"gpu-product": "x"}}},  # a key that looks like a kind's name stays in the path
     [("knobs.labels.gpu-product", "Input should be a valid integer, unable to parse string as an integer")]),
    ({"knobs": {"betta": 1}}, [("knobs.betta", "unknown key; did you mean beta?")]),
])
def test_unions_and_keys_are_said_as_written(given, expected):
    with pytest.raises(ValidationError) as refused:
        Outer.model_validate(given)
    assert described_errors(refused.value.errors(), Outer) == expected


class PlanRequest(BaseModel):
    spec: FineTuneJobSpec


def test_a_rule_of_a_nested_model_is_said_at_the_field_it_names():
    with pytest.raises(ValidationError) as refused:
        PlanRequest.model_validate({"spec": {**SPEC, "method": {"objective": "dpo"}}})
    ((where, _what),) = described_errors(refused.value.errors(), PlanRequest)
    assert where == "spec.dataset.format"
    assert said({"method": {"type": "full", "lora": {"quantization": "nf4"}}}) == [
        ("method.lora.quantization", "nf4 loads a frozen LoRA base in 4 bits, but type full trains every weight: set "
                                     "type lora, or lora.quantization none")]


def test_bounds_are_written_as_numbers_are():
    ((_where, what),) = said({"resources": {"budgetUSD": -1}})
    assert what.endswith("(allowed: more than 0, at most 1,000,000,000)"), what
