"""API tokens (admin only): issue one for a tenant, list them (never their secrets), revoke one."""

from typing import Annotated

from fastapi import APIRouter, Query
from sqlmodel import select

from tunewright_api.auth import AdminToken, SessionDep, issue_token
from tunewright_api.errors import ApiError
from tunewright_api.models import ApiToken, Tenant, TokenCreate, TokenPublic
from tunewright_api.routes.links import links_from
from tunewright_api.schemas import Deleted, TokenList

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


def public(token: ApiToken, tenant: Tenant, secret: str | None = None) -> TokenPublic:
    return TokenPublic(id=token.id, tenant=tenant.name, name=token.name, admin=token.admin,
                       created_at=token.created_at, token=secret)


@router.post("", status_code=201, responses=links_from(201, "id", "token_id", ("delete", "/v1/tokens/{token_id}")))
def create_token(body: TokenCreate, session: SessionDep, _: AdminToken) -> TokenPublic:
    """A token for a tenant (created if new). The secret is returned once."""
    tenant, token, secret = issue_token(session, body.tenant, body.name, body.admin)
    return public(token, tenant, secret)


@router.get("")
def list_tokens(session: SessionDep, _: AdminToken, tenant: str | None = None,
                limit: Annotated[int, Query(ge=1, le=100)] = 100) -> TokenList:
    """Newest first; `tenant` narrows to one tenant's."""
    query = select(ApiToken, Tenant).join(Tenant, Tenant.id == ApiToken.tenant_id)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    rows = session.exec(query.order_by(ApiToken.created_at.desc(), ApiToken.id.desc()).limit(limit + 1)).all()
    return TokenList(data=[public(t, owner) for t, owner in rows[:limit]], has_more=len(rows) > limit)


@router.delete("/{token_id}")
def revoke_token(token_id: str, session: SessionDep, _: AdminToken) -> Deleted:
    """From now on the token authenticates nothing (the admin token the settings give is made again at the
    next start: change the setting to retire it)."""
    token = session.get(ApiToken, token_id)
    if token is None:
        raise ApiError(404, f"no token {token_id}", "token_id", "not_found")
    session.delete(token)
    session.commit()
    return Deleted(id=token_id, object="token")
