"""The FastAPI application: `uvicorn tunewright_api.main:app`, or `create_app(settings)` in tests."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from sqlmodel import Session

from tunewright_api import errors
from tunewright_api.auth import bootstrap_admin
from tunewright_api.backends import local_folder, make_backend
from tunewright_api.db import make_engine, migrate
from tunewright_api.deps import check_url_values
from tunewright_api.limits import RequestLimits
from tunewright_api.prometheus import RequestTimer
from tunewright_api.routes import files, fine_tuning, health, jobs, pools, telemetry, tokens, ui
from tunewright_api.services.files import sweep_all_partials
from tunewright_api.settings import Settings, get_settings

log = logging.getLogger(__name__)


class WithoutQueryStrings(logging.Filter):
    """uvicorn's access log without query strings: a token someone put in a URL (refused) is not kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5 and "?" in str(record.args[2]):
            client, method, path, version, status = record.args
            record.args = (client, method, str(path).split("?", 1)[0] + "?…", version, status)
        return True


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        # the local backend's folder has one API (local_folder): claimed before anything in it is touched (its
        # database, its admin token), so a refused API changes nothing of the one that has it
        folder = local_folder.claim(settings.data_dir, settings.public_url) if settings.backend == "local" else None
        try:
            sweep_all_partials(settings.data_dir)
            engine = make_engine(settings.resolved_database_url)
            migrate(engine)
            if settings.admin_token:
                with Session(engine) as session:
                    bootstrap_admin(session, settings.admin_token)
            backend = make_backend(settings, engine)
            app.state.settings, app.state.engine, app.state.backend = settings, engine, backend
            backend.start()
            try:
                yield
            finally:
                backend.stop()
                engine.dispose()
        finally:
            if folder is not None:
                local_folder.release(settings.data_dir, folder)

    app = FastAPI(title="tunewright", version="0.1.0", lifespan=lifespan, dependencies=[Depends(check_url_values)],
                  description="Fine-tuning jobs: submit, watch, measure. OpenAI-compatible where it can be.")
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, WithoutQueryStrings) for f in access.filters):
        access.addFilter(WithoutQueryStrings())
    app.add_middleware(RequestLimits, max_upload_bytes=settings.max_upload_bytes)
    errors.install(app)
    app.add_middleware(RequestTimer)  # outermost: a request's whole time, refusals and errors included
    for router in (health.router, tokens.router, files.router, jobs.router, fine_tuning.router, pools.router,
                   telemetry.router, ui.router):
        app.include_router(router)
    return app


app = create_app()
