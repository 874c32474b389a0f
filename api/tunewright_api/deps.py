"""Request dependencies beside the session and the caller (auth.py): the settings, the backend, and what a
value taken from the URL may be."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tunewright_api.backends import Backend
from tunewright_api.errors import ApiError
from tunewright_api.names import name_problem
from tunewright_api.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_backend(request: Request) -> Backend:
    return request.app.state.backend


SettingsDep = Annotated[Settings, Depends(get_settings)]
BackendDep = Annotated[Backend, Depends(get_backend)]


def url_value_refusal(name: str, value: str) -> ApiError | None:
    """The 422 naming the URL's parameter `name` when its value cannot name anything here, or None."""
    problem = name_problem(value)
    return None if problem is None else ApiError(422, f"{name} {problem}: send it as it was listed", name,
                                                 "invalid_value")


def check_url_values(request: Request) -> None:
    """Every route's path and query values, refused naming the parameter before any route looks them up."""
    for name, value in [*request.path_params.items(), *request.query_params.multi_items()]:
        if (refusal := url_value_refusal(name, value)) is not None:
            raise refusal
