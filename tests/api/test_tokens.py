"""Tokens can be listed (never their secrets) and revoked, and a restart with a new admin token retires the
old one (issue 15, item 9)."""

import json

from tests.api.conftest import ADMIN, Server
from tunewright_api import cli


def test_a_revoked_token_authenticates_nothing(tmp_path):
    with Server(tmp_path / "data", local_ray=False) as api:
        admin = api.client()
        issued = admin.post("/v1/tokens", json={"tenant": "alice", "name": "laptop"}).json()
        assert issued["id"].startswith("tok-") and issued["token"].startswith("tw-")
        alice = api.client(issued["token"])
        assert alice.get("/v1/jobs").status_code == 200
        listed = admin.get("/v1/tokens?tenant=alice").json()["data"]
        assert [(t["id"], t["name"], t["token"]) for t in listed] == [(issued["id"], "laptop", None)]
        assert alice.get("/v1/tokens").status_code == 403 and alice.delete(f"/v1/tokens/{issued['id']}").status_code == 403
        assert admin.delete(f"/v1/tokens/{issued['id']}").json() == {"id": issued["id"], "object": "token",
                                                                       "deleted": True}
        assert alice.get("/v1/jobs").status_code == 401
        missing = admin.delete(f"/v1/tokens/{issued['id']}")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "token_id"


def test_a_restart_with_a_new_admin_token_retires_the_old_one(tmp_path):
    with Server(tmp_path / "data", local_ray=False) as api:
        assert api.client().get("/v1/tokens").status_code == 200
    with Server(tmp_path / "data", local_ray=False, admin_token="tw-the-new-admin-token") as api:
        assert api.client(ADMIN).get("/v1/tokens").status_code == 401
        assert api.client("tw-the-new-admin-token").get("/v1/tokens").status_code == 200


def test_the_cli_lists_and_revokes_tokens(tmp_path, capsys):
    with Server(tmp_path / "data", local_ray=False) as api:
        base = ["--url", api.url, "--token", ADMIN]
        assert cli.main([*base, "-o", "json", "tokens", "create", "bob"]) == 0
        token_id = json.loads(capsys.readouterr().out)["id"]
        assert cli.main([*base, "tokens", "list", "bob"]) == 0
        assert token_id in capsys.readouterr().out
        assert cli.main([*base, "tokens", "revoke", token_id]) == 0
        assert api.client().get("/v1/tokens?tenant=bob").json()["data"] == []
