"""Bearer tokens: stored as sha256 of a random secret; a token belongs to one tenant."""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from tunewright_api.models import ApiToken, Tenant


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "tw-" + secrets.token_urlsafe(32)


def tenant_named(session: Session, name: str) -> Tenant:
    """The tenant of that name, created if new: two concurrent first requests make one tenant (the loser of
    the race on the unique name reads the winner's)."""
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is not None:
        return tenant
    try:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.commit()  # at once: the unique name is what concurrent requests race on
        return tenant
    except IntegrityError:
        session.rollback()
        return session.exec(select(Tenant).where(Tenant.name == name)).one()


def issue_token(session: Session, tenant_name: str, name: str = "", admin: bool = False,
                token: str | None = None) -> tuple[Tenant, ApiToken, str]:
    """Create the tenant if needed and a token for it; returns the secret (shown once)."""
    tenant = tenant_named(session, tenant_name)
    token = token or new_token()
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    if row is None:
        row = ApiToken(tenant_id=tenant.id, name=name, token_hash=hash_token(token), admin=admin)
        session.add(row)
    session.commit()
    return tenant, row, token


BOOTSTRAP = "bootstrap"


def bootstrap_admin(session: Session, token: str) -> None:
    """The admin token the settings give, and no earlier one: a restart with a new token retires the old."""
    _, current, _ = issue_token(session, "admin", BOOTSTRAP, admin=True, token=token)
    for old in session.exec(select(ApiToken).where(ApiToken.name == BOOTSTRAP, ApiToken.admin,
                                                   ApiToken.id != current.id)).all():
        session.delete(old)
    session.commit()


def get_session(request: Request):
    with Session(request.app.state.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def bearer_token(authorization: str | None) -> str:
    """What a `Bearer` header carries, or "" (then no token matches): for the workers' routes, whose token
    is checked against the job's own."""
    return (authorization or "").removeprefix("Bearer ").strip()


def _bearer(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>'")
    return token.strip()


def token_of(session: Session, authorization: str | None) -> ApiToken:
    """The token an Authorization header carries; 401 when it carries none, or one unknown here."""
    token = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(_bearer(authorization)))).first()
    if token is None:
        raise HTTPException(401, "invalid token")
    return token


def current_token(session: SessionDep, authorization: Annotated[str | None, Header()] = None) -> ApiToken:
    return token_of(session, authorization)


TokenDep = Annotated[ApiToken, Depends(current_token)]


def current_tenant(token: TokenDep, session: SessionDep) -> Tenant:
    return session.get(Tenant, token.tenant_id)


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def require_admin(token: TokenDep) -> ApiToken:
    if not token.admin:
        raise HTTPException(403, "this route needs an admin token")
    return token


AdminToken = Annotated[ApiToken, Depends(require_admin)]
