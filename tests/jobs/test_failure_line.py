"""A failed run's last line says why in words a user can act on (the job's error is that line)."""

import pytest

from tunewright_jobs.run import failure_line


class FakeRayTaskError(RuntimeError):
    """Ray's shape: the worker's exception in `.cause`, a remote traceback as the text."""

    def __init__(self, cause):
        super().__init__("ray::_RayTrainWorker.execute()\n  File ...\n  many lines")
        self.cause = cause


def wrapped(inner: BaseException) -> BaseException:
    outer = RuntimeError("Training failed due to an error in a worker")
    outer.__cause__ = FakeRayTaskError(inner)
    return outer


@pytest.mark.parametrize(("error", "expected"), [
    (OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
             "cached files.\nCheck your internet connection"),
     "model.source: org/m cannot be downloaded: the Hugging Face Hub is not reachable from here."),
    (ValueError("Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/no/such/dir'."),
     "model.source: org/m is neither a folder here nor a model on the Hugging Face Hub"),
    (OSError("You are trying to access a gated repo.\nMake sure to have access to it"),
     "model.source: org/m needs a Hugging Face token with access to it (HF_TOKEN)"),
    (wrapped(OSError("We couldn't connect to 'https://huggingface.co'")),  # from a Ray worker
     "model.source: org/m cannot be downloaded"),
    (wrapped(ZeroDivisionError("division by zero\nmore")), "ZeroDivisionError: division by zero"),
    (KeyError(), "KeyError: no message"),
])
def test_failure_line(error, expected):
    line = failure_line(error, "org/m")
    assert line.startswith(expected) and "\n" not in line
