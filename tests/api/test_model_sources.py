"""Where a job's model may be read from: never another tenant's files in the server's data folder; and a dry
run sizes a spec the way a submitted job is sized."""

import shutil
from pathlib import Path

import pytest
from sqlmodel import Session, select

from tests.api.conftest import TRAIN, Server, tiny_spec, upload
from tunewright_api.models import Job, Tenant

H100 = {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4", "pricePerGPUHour": 4.0}


@pytest.fixture
def quiet_server(tmp_path):
    """No job is ever launched (none may run at once): submitting is all these tests need."""
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as s:
        yield s


def exported_job(server: Server, tenant: str, model: Path) -> Path:
    """A succeeded job of `tenant` whose export (a merged model) sits in the server's data folder, as the local
    backend leaves it; the merged model's folder."""
    with Session(server.app.state.engine) as session:
        owner = session.exec(select(Tenant).where(Tenant.name == tenant)).one()
        job = Job(tenant_id=owner.id, status="succeeded", model=str(model), spec={})
        job.run_dir = str(server.settings.data_dir.resolve() / "jobs" / job.id)
        merged = Path(job.run_dir) / "output" / "final" / "merged"
        shutil.copytree(model, merged)
        job.result = {"export": {"adapter": str(merged.with_name("adapter")), "merged": str(merged)}}
        session.add(job)
        session.commit()
    return merged


def test_a_tenant_never_trains_on_another_tenants_export(quiet_server, tiny_models, tmp_path):
    alice, bob = quiet_server.tenant("alice"), quiet_server.tenant("bob")
    export = exported_job(quiet_server, "alice", tiny_models["gpt2"])
    link = tmp_path / "innocent-looking"
    link.symlink_to(export)
    data = quiet_server.settings.data_dir
    for source in (export, export.parent, link, data / "files" / ".." / "jobs" / export.relative_to(data / "jobs"),
                   data.resolve(), data / "tunewright.db"):
        refused = bob.post("/v1/jobs", json=tiny_spec(source, upload(bob, TRAIN).json()["id"]))
        assert refused.status_code == 422, (source, refused.text)
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("model.source", "model_path_not_allowed")
        assert "data folder" in error["message"] and "your own" in error["message"]  # the reason and the fix
        dry_run = bob.post("/v1/plans", json={"spec": tiny_spec(source, "file-x"), "poolSpec": H100})
        assert dry_run.status_code == 422 and dry_run.json()["error"]["code"] == "model_path_not_allowed"
    openai = bob.post("/v1/fine_tuning/jobs", json={"model": str(export), "training_file": upload(bob, TRAIN).json()["id"],
                                                    "seq_len": 128})
    assert openai.json()["error"]["code"] == "model_path_not_allowed" and openai.json()["error"]["param"] == "model"

    # fine-tuning one's own export further is a feature; the job reads the folder that was checked
    train = upload(alice, TRAIN).json()["id"]
    own = alice.post("/v1/jobs", json=tiny_spec(export, train))
    assert own.status_code == 201, own.text
    through_link = alice.post("/v1/jobs", json=tiny_spec(link, train))
    assert through_link.status_code == 201 and through_link.json()["model"] == str(export)
    assert alice.post("/v1/plans", json={"spec": tiny_spec(link, train), "poolSpec": H100}).status_code == 200
    # the rest of the data folder is nobody's to read, the owner's included
    assert alice.post("/v1/jobs", json=tiny_spec(data / "files", train)).json()["error"]["code"] == \
        "model_path_not_allowed"


def test_a_dry_run_sizes_a_spec_without_seqlen_as_submitting_it_does(quiet_server, tiny_models):
    """The tiny GPT-2 has 512 positions: the default seqLen (2048) would not fit it; a job sizes seqLen from
    its data, and so must the dry run of the same spec."""
    alice = quiet_server.tenant("alice")
    spec = tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"])
    del spec["hyperparameters"]["seqLen"]
    assert alice.post("/v1/jobs", json=spec).status_code == 201
    dry_run = alice.post("/v1/plans", json={"spec": spec, "poolSpec": H100})
    assert dry_run.status_code == 200, dry_run.text


@pytest.mark.parametrize("source", ["x" * 300, "/" + "y" * 300, "hf://org/" + "z" * 1000])
def test_a_model_name_longer_than_any_file_name_is_refused_naming_the_field(quiet_server, source):
    alice = quiet_server.tenant("alice")
    refused = alice.post("/v1/jobs", json=tiny_spec(Path("/unused"), upload(alice, TRAIN).json()["id"])
                         | {"model": {"source": source}})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "model.source" and "at most 255" in refused.json()["error"]["message"]


@pytest.mark.parametrize("source", ["output/../../../../../../srv/private/Llama-3.1-8B", "a/b/c", "../x", "./x"])
def test_a_model_path_the_run_would_read_relative_to_its_folder_is_a_path_not_a_hub_name(quiet_server, source):
    """Only `name` or `org/name` is a hub id: anything else would be read by the run relative to its own
    folder (the roots and the data folder never checked), so it is checked as a path, and refused relative."""
    alice = quiet_server.tenant("alice")
    refused = alice.post("/v1/jobs", json=tiny_spec(Path("/unused"), upload(alice, TRAIN).json()["id"])
                         | {"model": {"source": source}})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "model.source" and "must be absolute" in refused.json()["error"]["message"]


def test_an_export_a_run_reports_elsewhere_opens_nothing_there(quiet_server, tiny_models):
    """A run's end record names its export; a run (its token) could name any folder, the data folder's
    uploads say: what a tenant may read and download is where the server ran the job, whatever it reported."""
    alice = quiet_server.tenant("alice")
    merged = exported_job(quiet_server, "alice", tiny_models["llama"])
    uploads = quiet_server.settings.data_dir.resolve() / "files"
    with Session(quiet_server.app.state.engine) as session:
        job = session.exec(select(Job).where(Job.status == "succeeded")).one()
        job.result = {"export": {"merged": str(uploads / "anything")}}
        session.add(job)
        session.commit()
    train = upload(alice, TRAIN).json()["id"]
    assert alice.post("/v1/jobs", json=tiny_spec(merged, train)).status_code == 201  # its own export still
    refused = alice.post("/v1/jobs", json=tiny_spec(uploads, train))
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "model_path_not_allowed", refused.text
