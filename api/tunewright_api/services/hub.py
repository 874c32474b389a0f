"""Whether a hub model can be had where its job will run, said at submit rather than after a minute of
start-up: this machine's Hugging Face cache first (no network), then the hub itself (one request, bounded).

On the local backend the run reads this machine's cache and network, so a model found in neither is
refused. On a cluster the workers fetch it with their own cache and network: only a hub that answers that
the model does not exist refuses it there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

HUB_TIMEOUT_SECONDS = 1.5
DEFAULT_ENDPOINT = "https://huggingface.co"
OFF = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Availability:
    found: bool  # in the cache, or the hub serves its config.json
    said: str  # where it was looked for and what was seen (for a refusal)
    missing: bool = False  # the hub answered that it has no such model
    authenticated: bool = False  # asked with a token (a 404 may then be another account's private model)


def cache_folder(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloaded models (its own order of variables)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    root = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return root / "huggingface" / "hub"


def in_cache(name: str, env: Mapping[str, str]) -> bool:
    folder = cache_folder(env) / f"models--{name.replace('/', '--')}" / "snapshots"
    return any(folder.glob("*/config.json"))


def hub_token(env: Mapping[str, str]) -> str | None:
    """HF_TOKEN, else the token `huggingface-cli login` saved (HF_TOKEN_PATH, else HF_HOME's or the cache's)."""
    if env.get("HF_TOKEN"):
        return env["HF_TOKEN"]
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else (
        Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache") / "huggingface"
    path = Path(env["HF_TOKEN_PATH"]).expanduser() if env.get("HF_TOKEN_PATH") else home / "token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def on_hub(name: str, env: Mapping[str, str], client: httpx.Client | None = None,
           revision: str | None = None) -> Availability:
    """One HEAD of the model's config.json at `revision` on the hub (HF_ENDPOINT, with the hub token)."""
    if env.get("HF_HUB_OFFLINE", "").lower() in OFF:
        return Availability(False, "the hub was not asked (HF_HUB_OFFLINE is set)")
    endpoint = env.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    token = hub_token(env)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/{name}/resolve/{quote(revision or 'main', safe='')}/config.json"
    answer: list[int | Exception] = []

    def ask() -> None:
        try:
            with client or httpx.Client(timeout=HUB_TIMEOUT_SECONDS) as http:
                answer.append(http.head(url, headers=headers, follow_redirects=False).status_code)
        except httpx.HTTPError as err:
            answer.append(err)

    # on a thread joined with a deadline: a name lookup is not bounded by httpx's timeout
    asking = threading.Thread(target=ask, name="tunewright-hub-lookup", daemon=True)
    asking.start()
    asking.join(HUB_TIMEOUT_SECONDS + 0.5)
    if not answer:
        return Availability(False, f"the hub ({endpoint}) did not answer within {HUB_TIMEOUT_SECONDS:g} s")
    status = answer[0]
    if isinstance(status, Exception):
        return Availability(False, f"the hub ({endpoint}) could not be reached: {type(status).__name__}: "
                                   f"{status}"[:300])
    if status < 400:  # 200, or a redirect to the file's storage
        return Availability(True, f"on the hub ({endpoint})")
    if status in (401, 403):
        return Availability(False, f"the hub ({endpoint}) refuses it without access (HTTP {status}: a gated or "
                                   "private model; accept its licence on the hub and set HF_TOKEN)")
    if status == 404:
        return Availability(False, f"the hub ({endpoint}) has no model {name} at {revision or 'main'} (HTTP 404)",
                            missing=True, authenticated=token is not None)
    return Availability(False, f"the hub ({endpoint}) answered HTTP {status}")


def availability(name: str, env: Mapping[str, str] | None = None, client: httpx.Client | None = None,
                 revision: str | None = None) -> Availability:
    env = os.environ if env is None else env
    if in_cache(name, env):
        return Availability(True, f"in this machine's Hugging Face cache ({cache_folder(env)})")
    hub = on_hub(name, env, client, revision)
    if hub.found:
        return hub
    return Availability(False, f"not in this machine's Hugging Face cache ({cache_folder(env)}); {hub.said}",
                        hub.missing, hub.authenticated)


def refusal(source: str, found: Availability, runs_here: bool) -> str | None:
    """Why a job naming hub model `source` cannot run, or None (it can, or only its workers can tell)."""
    # on a cluster the workers fetch it with their own credentials: only a 404 to an anonymous question (no
    # account's private model) says it does not exist
    if found.found or not (runs_here or (found.missing and not found.authenticated)):
        return None
    name = source.removeprefix("hf://")
    fix = ("check the name (org/name, as on the hub), or name a local folder holding the model (./folder, "
           "with its config.json)" if found.missing else
           f"download it where the hub can be reached (huggingface-cli download {name}) into this cache, or "
           "name a local folder holding the model (./folder, with its config.json)")
    return f"model {source} cannot be had: {found.said}. To fix: {fix}"
