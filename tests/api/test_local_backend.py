"""The local backend's pure parts: what a job's processes inherit."""

from tunewright_api.backends.local import job_environment

API_ENVIRONMENT = {"PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0,1",
                   "NCCL_DEBUG": "WARN", "HF_HOME": "/models", "PYTHONPATH": "/src",
                   "TUNEWRIGHT_ADMIN_TOKEN": "secret", "TUNEWRIGHT_DATABASE_URL": "postgresql://u:pw@db/tw",
                   "RAY_ADDRESS": "10.0.0.9:6379", "AWS_SECRET_ACCESS_KEY": "x"}


def test_a_job_inherits_what_training_reads_and_no_secret_of_the_api():
    env = job_environment(API_ENVIRONMENT, "job-token", ray_address=None)
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0,1",
                   "NCCL_DEBUG": "WARN", "HF_HOME": "/models", "PYTHONPATH": "/src",
                   "TUNEWRIGHT_TELEMETRY_TOKEN": "job-token"}


def test_the_ray_cluster_is_the_one_the_backend_was_given():
    assert job_environment(API_ENVIRONMENT, "t", ray_address="127.0.0.1:6380")["RAY_ADDRESS"] == "127.0.0.1:6380"
    assert "RAY_ADDRESS" not in job_environment(API_ENVIRONMENT, "t", ray_address=None)
