"""Request dependencies beside the session and the caller (auth.py): the settings and the backend."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tunewright_api.backends import Backend
from tunewright_api.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_backend(request: Request) -> Backend:
    return request.app.state.backend


SettingsDep = Annotated[Settings, Depends(get_settings)]
BackendDep = Annotated[Backend, Depends(get_backend)]
