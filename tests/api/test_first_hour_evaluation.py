"""The first hour (issue items 4 and 7): a job's evaluations are seen where its owner looks. `tunewright get`
shows them before -> after training, as the run's summary does (one function for both); the OpenAI route's
results file carries every evaluation, exact match included; a batch the data cannot fill is refused plainly."""

import csv
import io
from pathlib import Path

import pytest
from sqlmodel import Session

from tunewright_api.auth import hash_token, issue_token
from tunewright_api.cli import render
from tunewright_api.db import make_engine, migrate
from tunewright_api.models import Job, StoredFile, camel_keys
from tunewright_api.services import telemetry as service
from tunewright_api.telemetry import parse_records

BEFORE = {"val_loss": 7.61304, "val_token_accuracy": 0.003, "exact_match": 0.0, "exact_match_examples": 100}
AFTER = {"val_loss": 0.01234, "val_token_accuracy": 0.997, "exact_match": 0.99, "exact_match_examples": 100}


def finished_job(result: dict | None) -> dict:
    """A job as `GET /v1/jobs/{id}` answers it (what `tunewright get` renders): the run's result camelCase."""
    return {"id": "ftjob-abc", "status": "succeeded", "model": "/models/tiny-gpt2", "spec": {"method": {"type": "lora"}},
            "plan": None, "progress": {"step": 10, "totalSteps": 10, "loss": 0.02, "tokensPerSecond": 900.0,
                         "trainedTokens": 9000},
            "telemetry": {}, "error": None, "result": camel_keys(result)}


def test_get_shows_each_evaluation_before_and_after_training():
    shown = render.job_text(finished_job({"steps": 10, "eval_before": BEFORE, "eval_after": AFTER,
                                          "export": {"adapter": "/data/run/final/adapter"}}))
    lines = shown.splitlines()
    at = lines.index("evaluation (validation set, before -> after training):")
    assert lines[at + 1:at + 4] == ["  validation loss  7.6130 -> 0.0123",
                                    "  token accuracy   0.3% -> 99.7%",
                                    "  exact match      0.0% -> 99.0%  (100 held-out examples)"]
    assert lines[at + 4].startswith("adapter:")


@pytest.mark.parametrize(("result", "expected"), [
    # a resumed run: its `before` was the first run's, so only `after`
    ({"eval_before": None, "eval_after": {**AFTER, "exact_match": None, "exact_match_examples": None}},
     [("validation loss", "0.0123"), ("token accuracy", "99.7%")]),
    # no exact match asked for: no line for it
    ({"eval_before": {"val_loss": 2.0, "val_token_accuracy": 0.5}, "eval_after": {"val_loss": 1.5,
                                                                                  "val_token_accuracy": 0.6}},
     [("validation loss", "2.0000 -> 1.5000"), ("token accuracy", "50.0% -> 60.0%")]),
    ({"eval_before": None, "eval_after": None}, []),  # no validation set
    (None, []),  # not finished
])
def test_evaluation_lines_name_only_what_was_measured(result, expected):
    assert render.evaluation(camel_keys(result)) == expected


def test_a_job_without_evaluations_gets_nothing_extra():
    shown = render.job_text(finished_job({"steps": 10, "eval_before": None, "eval_after": None, "export": {}}))
    assert "evaluation" not in shown and "->" not in shown


def test_the_run_summary_says_the_evaluation_as_get_does():
    job = {**finished_job({"steps": 10, "eval_before": BEFORE, "eval_after": AFTER}),
           "plan": {"explanation": "local pool: ddp", "device": "cpu", "gpus": 0, "workers": 2},
           "telemetry": {"commShare": None, "costUSD": None},
           "startedAt": "2026-01-01T00:00:00", "finishedAt": "2026-01-01T00:00:37"}
    summary = render.run_summary(job, [{"loss": 7.6, "tokensPerSecond": 1000.0}, {"loss": 0.002}])
    assert "validation loss    7.6130 -> 0.0123" in summary
    assert "token accuracy     0.3% -> 99.7%" in summary
    assert "exact match        0.0% -> 99.0%  (100 held-out examples)" in summary


def step(n: int) -> dict:
    return {"event": "step", "step": n, "epoch": 0, "loss": 3.0 - n / 10, "learning_rate": 1e-3, "grad_norm": 1.0,
            "tokens": 100, "tokens_per_second": 1e3, "step_seconds": 0.1, "data_seconds": 0.0,
            "forward_backward_seconds": 0.08, "optimizer_seconds": 0.02}


def results_of(tmp_path, records: list[dict], spec: dict | None = None) -> list[dict]:
    """The results file (OpenAI's `result_files`) of a job (of `spec`) that sent `records`, as rows."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    accepted, rejected = parse_records(records)
    assert not rejected
    with Session(engine) as session:
        tenant_id = issue_token(session, "alice")[0].id
        job = Job(tenant_id=tenant_id, model="m", spec=spec or {}, status="running",
                  telemetry_token_hash=hash_token("t"))
        session.add(job)
        session.commit()
        service.ingest(session=session, job=job, records=accepted, data_dir=tmp_path)
        (results_id,) = job.result["result_files"]
        text = Path(session.get(StoredFile, results_id).path).read_text()
    return list(csv.DictReader(io.StringIO(text)))


def test_the_results_file_carries_every_evaluation(tmp_path):
    """Before training (step 0, with exact match), every few steps (loss and accuracy), and at the end (with
    exact match again): each on its step's row, under our columns and OpenAI's."""
    end = {"event": "end", "step": 6, "steps": 6, "final_loss": 2.4, "eval_before": BEFORE, "eval_after": AFTER,
           "export": {"adapter": "/run/final/adapter"}, "strategy": "ddp", "workers": 1, "resumed_from_step": 0}
    rows = results_of(tmp_path, [
        {"event": "start", "step": 0, "total_steps": 6}, {"event": "eval", "step": 0, **BEFORE},
        *map(step, range(1, 4)), {"event": "eval", "step": 3, "val_loss": 3.5, "val_token_accuracy": 0.4},
        *map(step, range(4, 7)), {"event": "eval", "step": 6, **AFTER}, end])
    assert list(rows[0]) == ["step", "train_loss", "valid_loss", "valid_token_accuracy", "learning_rate",
                             "tokens_per_second", "valid_mean_token_accuracy", "valid_exact_match"]
    by_step = {int(r["step"]): r for r in rows}
    assert sorted(by_step) == list(range(7))
    evaluated = {s: (r["valid_loss"], r["valid_token_accuracy"], r["valid_mean_token_accuracy"],
                     r["valid_exact_match"]) for s, r in by_step.items() if r["valid_loss"]}
    assert evaluated == {0: ("7.61304", "0.003", "0.003", "0.0"), 3: ("3.5", "0.4", "0.4", ""),
                         6: ("0.01234", "0.997", "0.997", "0.99")}
    assert by_step[0]["train_loss"] == "" and by_step[6]["train_loss"] == "2.4"


def test_the_results_file_keeps_the_evaluations_the_result_holds(tmp_path):
    """An evaluation without a loss (not measured) still has its accuracy written; evaluations whose events
    are gone (trimmed on a long run) are written from the run's result, before and after training."""
    before = {**BEFORE, "val_loss": None}
    end = {"event": "end", "step": 2, "steps": 2, "final_loss": 2.8, "eval_before": before, "eval_after": AFTER,
           "export": {}, "strategy": "ddp", "workers": 1, "resumed_from_step": 0}
    rows = results_of(tmp_path, [{"event": "start", "step": 0, "total_steps": 2},
                                 {"event": "eval", "step": 0, **before}, step(1), step(2), end])
    by_step = {int(r["step"]): r for r in rows}
    assert (by_step[0]["valid_loss"], by_step[0]["valid_token_accuracy"], by_step[0]["valid_exact_match"]) == \
        ("", "0.003", "0.0")
    assert (by_step[2]["valid_loss"], by_step[2]["valid_exact_match"], by_step[2]["train_loss"]) == \
        ("0.01234", "0.99", "2.8")


@pytest.mark.parametrize(("hyper", "expected"), [
    ({"globalBatchSize": 4096},
     "hyperparameters.globalBatchSize: at most 300 sequences a step, not 4096; one epoch (150 examples) holds "
     "about 89 sequences of 128 tokens. Lower globalBatchSize or seqLen, or leave both out and tunewright sizes "
     "them from the data"),
    ({"globalBatchTokens": 2048 * 4096, "seqLen": 2048},
     "hyperparameters.globalBatchTokens: at most 36864 tokens a step, not 8388608; one epoch (150 examples) "
     "holds about 5 sequences of 2048 tokens. Lower globalBatchTokens or seqLen, or leave both out and "
     "tunewright sizes them from the data"),
])
def test_a_batch_the_data_cannot_fill_is_refused_plainly(hyper, expected):
    """The field first, then the limit and what one epoch of the data holds, then the fix."""
    from tunewright_core.planner.jobs import sized_for_data
    from tunewright_core.spec import FineTuneJobSpec

    spec = FineTuneJobSpec.model_validate({"model": {"source": "gpt2"},
                                           "dataset": {"train": "file-x"}, "hyperparameters": hyper})
    with pytest.raises(ValueError) as refused:
        sized_for_data(spec, examples=150, characters=150 * 240, longest_characters=400)
    assert str(refused.value) == expected


def test_a_dpo_jobs_results_file_carries_its_rewards(tmp_path):
    """Training rewards on every step's row, validation ones on each evaluated step's (a sft job's file has
    neither column: test above)."""
    rewards = {"reward_margin": 0.5, "preference_accuracy": 0.75, "chosen_reward": 0.3, "rejected_reward": -0.2}
    scores = {"val_loss": 0.6, "val_token_accuracy": 0.2, "preference_accuracy": 0.875, "reward_margin": 0.9}
    end = {"event": "end", "step": 2, "steps": 2, "final_loss": 0.6, "eval_before": None, "eval_after": scores,
           "export": {}, "strategy": "ddp", "workers": 1, "resumed_from_step": 0}
    rows = results_of(tmp_path, [{"event": "start", "step": 0, "total_steps": 2}, {**step(1), **rewards},
                                 {**step(2), **rewards}, {"event": "eval", "step": 2, **scores}, end],
                      spec={"method": {"objective": "dpo"}})
    assert list(rows[0])[-4:] == ["train_reward_margin", "train_preference_accuracy", "valid_reward_margin",
                                  "valid_preference_accuracy"]
    by_step = {int(r["step"]): r for r in rows}
    assert (by_step[1]["train_reward_margin"], by_step[1]["train_preference_accuracy"],
            by_step[1]["valid_reward_margin"]) == ("0.5", "0.75", "")
    assert (by_step[2]["valid_reward_margin"], by_step[2]["valid_preference_accuracy"]) == ("0.9", "0.875")
