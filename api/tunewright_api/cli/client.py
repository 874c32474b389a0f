"""The REST API as the CLI (and the demo) calls it: requests, errors a human can act on, uploads."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import httpx

# exit codes: the same meaning for every command
OK, REFUSED, USAGE, UNREACHABLE = 0, 1, 2, 3


class RequestFailed(RuntimeError):
    """The API refused the request, or could not be reached; the message is one line for a human."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    @property
    def exit_code(self) -> int:
        return REFUSED if self.status is not None and self.status < 500 else UNREACHABLE


# what to do next, by what the API answered (added to its own message)
HINTS = {
    401: "give a token with --token or TUNEWRIGHT_TOKEN (an admin makes one: tunewright tokens create TENANT)",
    403: "this needs an admin token",
    503: "the server is busy: retry in a few seconds",
}


class Client:
    def __init__(self, url: str, token: str | None, timeout: float = 60):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise RequestFailed(f"cannot reach the API at {self.http.base_url} ({type(err).__name__}): is "
                                "`tunewright serve` running there? (--url or TUNEWRIGHT_URL)") from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                message, param = str(error["message"]), error.get("param")
            except (ValueError, KeyError, TypeError):
                message, param = response.text[:300] or response.reason_phrase, None
            first = message.splitlines()[0] if message else ""
            # the message usually starts with the field already; name it only when it does not
            where = f"{param}: " if param and not first.startswith(param) else ""
            hint = f" ({HINTS[response.status_code]})" if response.status_code in HINTS else ""
            raise RequestFailed(f"{response.status_code}: {where}{first}{hint}", response.status_code, param)
        return response

    def request(self, method: str, path: str, **kwargs) -> dict:
        response = self.send(method, path, **kwargs)
        return response.json() if response.content else {}

    def pages(self, path: str, limit: int = 100, **params) -> list[dict]:
        """Every item of a paged list of a native route (`after` = the last id of the previous page)."""
        items, after = [], None
        while True:
            page = self.request("GET", path, params={**params, "limit": limit, **({"after": after} if after else {})})
            items += page["data"]
            if not page.get("hasMore") or not page["data"]:
                return items
            after = page["data"][-1]["id"]

    def upload(self, path: Path) -> dict:
        with path.open("rb") as fh:
            return self.request("POST", "/v1/files", files={"file": (path.name, fh)}, data={"purpose": "fine-tune"})

    def upload_once(self, path: Path) -> tuple[dict, bool]:
        """The tenant's upload of exactly these bytes if there is one, else a new upload; and whether it is new."""
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        found = self.request("GET", "/v1/files", params={"sha256": digest.hexdigest(), "purpose": "fine-tune",
                                                         "limit": 1})["data"]
        return (found[0], False) if found else (self.upload(path), True)

    def with_local_files(self, spec: dict, made: list[str]) -> dict:
        """The spec with its local dataset files uploaded (or found uploaded) and a local model path absolute;
        ids of new uploads are appended to `made` (the caller removes them if the submit is refused)."""
        spec = with_local_paths_checked(spec)
        dataset = spec.get("dataset") or {}
        for key in ("train", "validation"):
            if is_local_file(dataset.get(key)):
                uploaded, new = self.upload_once(Path(dataset[key]).expanduser())
                dataset[key] = uploaded["id"]
                if new:
                    made.append(uploaded["id"])
        return spec

    def submit(self, spec: dict) -> dict:
        """Upload what is local, submit; a refused submit leaves none of the uploads it made behind."""
        made: list[str] = []
        try:
            return self.request("POST", "/v1/jobs", json=self.with_local_files(spec, made))
        except RequestFailed:
            for file_id in made:
                with contextlib.suppress(RequestFailed):  # best effort: the refusal is what the user must see
                    self.request("DELETE", f"/v1/files/{file_id}")
            raise


def is_local_file(value: str | None) -> bool:
    """Whether a dataset value names a file on this machine (not an uploaded file id, file-..., nor a volume or URL)."""
    return bool(value) and not value.startswith("file-") and "://" not in value


def with_local_paths_checked(spec: dict) -> dict:
    """A copy of the spec whose local dataset files and model folders (model.source, a dpo job's
    method.dpo.reference) are here (RequestFailed naming the field when one is not), with a local model path made
    absolute; no request is made."""
    spec = json.loads(json.dumps(spec))
    dataset = spec.get("dataset") or {}
    for key in ("train", "validation"):
        value = dataset.get(key)
        if is_local_file(value) and not Path(value).expanduser().is_file():
            raise RequestFailed(f"dataset.{key}: no file {value} here (nor is it an uploaded file id, file-...: "
                                "tunewright files list)", 422, f"dataset.{key}")
    model = spec.get("model") or {}
    method = spec.get("method") if isinstance(spec.get("method"), dict) else {}
    dpo = method.get("dpo") if isinstance(method.get("dpo"), dict) else {}
    for field, holder, key in (("model.source", model, "source"), ("method.dpo.reference", dpo, "reference")):
        source = str(holder.get(key) or "")
        looks_local = source.startswith(("/", ".", "~"))
        if source and (looks_local or Path(source).expanduser().is_dir()):
            path = Path(source).expanduser()
            if not (path / "config.json").is_file():
                raise RequestFailed(f"{field}: no model folder {source} here (a folder with a config.json; a "
                                    "hub model is named org/name)", 422, field)
            holder[key] = str(path.resolve())  # the server wants it absolute
    return spec
