"""Absurd specs are refused at submit, naming the field (issue 15, item 11): bounds in the spec (and so in
the CRD), sizes that follow from the model (positions, hidden size), no control characters in paths, and
OpenAI's own metadata limits on its route."""

import pytest

from tests.api.conftest import TRAIN, Server, tiny_spec, upload


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("bounds"), local_ray=False) as s:
        yield s


@pytest.fixture(scope="module")
def alice(api):
    return api.tenant("alice")


@pytest.fixture(scope="module")
def train(alice):
    return upload(alice, TRAIN).json()["id"]


@pytest.mark.parametrize(("section", "patch", "field"), [
    ("hyperparameters", {"epochs": 10**30}, "hyperparameters.epochs"),
    ("hyperparameters", {"maxSteps": 10**30}, "hyperparameters.maxSteps"),
    ("hyperparameters", {"seqLen": 10**12}, "hyperparameters.seqLen"),
    ("hyperparameters", {"globalBatchSize": 10**12}, "hyperparameters.globalBatchSize"),
    ("hyperparameters", {"learningRate": 1e308}, "hyperparameters.learningRate"),
    ("hyperparameters", {"seqLen": 1024}, "hyperparameters.seqLen"),  # the tiny GPT-2 has 512 positions
    ("method", {"type": "lora", "lora": {"r": 10**9}}, "method.lora.r"),
    ("method", {"type": "lora", "lora": {"r": 128}}, "method.lora.r"),  # its hidden size is 64
    ("method", {"type": "lora", "lora": {"targetModules": ["q_proj\nrm -rf"]}}, "method.lora.targetModules.0"),
    # a GPT-2 has c_attn, c_proj and c_fc: a Llama's names match nothing in it
    ("method", {"type": "lora", "lora": {"targetModules": ["c_attn", "q_proj"]}}, "method.lora.targetModules"),
    ("evaluation", {"maxNewTokens": 10**9}, "evaluation.maxNewTokens"),
    ("model", {"source": "models/\x00tiny"}, "model.source"),
    ("model", {"source": "m" * 5000}, "model.source"),
    ("model", {"source": "/tmp/no/such/model"}, "model.source"),  # refused at once, not by the run later
])
def test_an_absurd_spec_is_refused_naming_the_field(alice, train, tiny_models, section, patch, field):
    spec = tiny_spec(tiny_models["gpt2"], train)
    spec[section] = {**spec.get(section, {}), **patch}
    response = alice.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == field, response.json()["error"]


@pytest.mark.parametrize(("metadata", "field"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata"),
])
def test_openai_metadata_keeps_openais_limits(alice, train, tiny_models, metadata, field):
    response = alice.post("/v1/fine_tuning/jobs", json={"model": str(tiny_models["gpt2"]), "training_file": train,
                                                         "metadata": metadata})
    assert response.status_code in (400, 422) and response.json()["error"]["param"].startswith(field), response.text


@pytest.mark.parametrize("source", ["/etc", "/proc/self/environ", "../../etc", "./models/../../../etc",
                                    "/tmp/../etc/ssl", "file:///etc"])
def test_a_model_path_in_the_systems_folders_is_never_read(alice, train, tiny_models, source):
    spec = tiny_spec(tiny_models["gpt2"], train)
    spec["model"]["source"] = source
    response = alice.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and response.json()["error"]["param"] == "model.source", response.text
    plan = alice.post("/v1/plans", json={"spec": spec, "pool": "x"})
    assert plan.status_code == 422


def test_with_model_roots_only_paths_under_them_are_read(tmp_path, tiny_models):
    with Server(tmp_path / "roots", local_ray=False, model_roots=[tiny_models["llama"].parent]) as api:
        alice = api.tenant("alice")
        train = upload(alice, TRAIN).json()["id"]
        inside = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train))
        assert inside.status_code == 201, inside.text
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        refused = alice.post("/v1/jobs", json=tiny_spec(outside, train))
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "model_path_not_allowed"
        assert str(tiny_models["llama"].parent.resolve()) in refused.json()["error"]["message"]
        alice.post(f"/v1/jobs/{inside.json()['id']}/cancel")
    with Server(tmp_path / "none", local_ray=False, model_roots=[]) as api:
        alice = api.tenant("alice")
        refused = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"]))
        assert refused.status_code == 422 and "set TUNEWRIGHT_MODEL_ROOTS" in refused.json()["error"]["message"]
