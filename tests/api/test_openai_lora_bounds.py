"""The OpenAI route's `lora` extra field takes the spec's settings with the spec's bounds (one definition:
tunewright_core.spec's LoRA types), refused at job creation naming the field."""

import pytest

from tests.api.conftest import TRAIN, Server, upload


@pytest.fixture
def quiet_server(tmp_path):
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as s:
        yield s


@pytest.mark.parametrize(("lora", "field"), [
    ({"r": 0}, "lora.r"),
    ({"r": 5000}, "lora.r"),
    ({"alpha": 0}, "lora.alpha"),
    ({"dropout": 1.0}, "lora.dropout"),
    ({"target_modules": []}, "lora.target_modules"),
    ({"target_modules": ["q_proj; rm -rf"]}, "lora.target_modules.0"),
])
def test_lora_settings_out_of_the_spec_s_bounds_are_refused(quiet_server, tiny_models, lora, field):
    alice = quiet_server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    refused = alice.post("/v1/fine_tuning/jobs", json={"model": str(tiny_models["gpt2"]), "training_file": train,
                                                       "lora": lora})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field
