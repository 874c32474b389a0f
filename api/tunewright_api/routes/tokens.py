from fastapi import APIRouter

from tunewright_api.auth import AdminToken, SessionDep, issue_token
from tunewright_api.models import TokenCreate, TokenPublic

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201)
def create_token(body: TokenCreate, session: SessionDep, _: AdminToken) -> TokenPublic:
    """Admin only: a token for a tenant (created if new). The secret is returned once."""
    tenant, token = issue_token(session, body.tenant, body.name, body.admin)
    return TokenPublic(id=tenant.id, tenant=tenant.name, token=token)
