"""The dashboard's files as the API serves them: from the package, under a strict Content-Security-Policy, with
nothing that reaches another host and no inline script or style; shipped in the wheel."""

import fnmatch
import re
from html.parser import HTMLParser

import pytest
import tomllib

from tests.api.conftest import Server
from tests.ui.conftest import ROOT
from tunewright_api.routes.ui import CONTENT_SECURITY_POLICY, UI_DIR

# the only URL allowed in a file: an XML namespace (a name, never fetched)
NAMESPACES = ("http://www.w3.org/2000/svg",)


class PageParts(HTMLParser):
    """What index.html loads, and anything inline a strict policy would refuse."""

    def __init__(self):
        super().__init__()
        self.loads, self.inline = [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        named = dict(attrs)
        if tag == "script":
            self._in_script = True
            if "src" not in named:
                self.inline.append("a <script> without src")
            else:
                self.loads.append(named["src"])
        if tag == "link" and named.get("rel") in ("stylesheet", "icon"):
            self.loads.append(named["href"])
        if tag == "style":
            self.inline.append("a <style> element")
        self.inline += [f"{tag} {name}=" for name, _ in attrs if name == "style" or name.startswith("on")]

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline.append("an inline script")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("ui-assets") / "data", local_ray=False) as server:
        yield server


def test_the_page_and_its_assets_are_served_under_a_strict_policy(api):
    with api.client(token=None) as anonymous:  # the files hold no data: no token needed to load them
        moved = anonymous.get("/ui", follow_redirects=False)
        assert moved.status_code == 308 and moved.headers["location"] == "/ui/"
        page = anonymous.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "script-src 'self';" in CONTENT_SECURITY_POLICY and "'unsafe" not in CONTENT_SECURITY_POLICY
        assert "connect-src 'self'" in CONTENT_SECURITY_POLICY and "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
        parts = PageParts()
        parts.feed(page.text)
        assert parts.inline == []
        assert set(parts.loads) == {"vendor/uPlot.iife.min.js", "app.js", "vendor/uPlot.min.css", "app.css", "favicon.svg"}
        types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
        for asset in parts.loads:
            served = anonymous.get(f"/ui/{asset}")
            assert served.status_code == 200, asset
            assert served.headers["content-type"].startswith(types[asset[asset.rindex("."):]]), asset
            assert served.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert served.headers["x-content-type-options"] == "nosniff"
            assert served.content == (UI_DIR / asset).read_bytes()
        assert anonymous.get("/ui/vendor/uPlot.LICENSE").text.startswith("The MIT License")
        # only the shipped files exist here: nothing beside them, above them, or of the server's own
        for path in ("missing.js", "../routes/ui.py", "%2e%2e/main.py", "..%2fmain.py", "vendor/README.md",
                     "/etc/passwd"):
            assert anonymous.get(f"/ui/{path}").status_code == 404, path
        assert anonymous.get("/v1/jobs").status_code == 401  # the data stays behind the token
        assert not [p for p in anonymous.get("/openapi.json").json()["paths"] if p.startswith("/ui")]


def test_no_asset_reaches_another_host_or_writes_html():
    shipped = [p for p in UI_DIR.rglob("*") if p.is_file() and p.suffix in (".html", ".js", ".css", ".svg")]
    assert len(shipped) == 6
    for path in shipped:
        text = re.sub(r"/\*!.*?\*/", "", path.read_text(), flags=re.DOTALL)  # a library's licence banner
        urls = [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text) if u not in NAMESPACES]
        assert urls == [], (path.name, urls)
        assert "@import" not in text and "url(" not in text, path.name
    ours = (UI_DIR / "app.js").read_text()
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert unsafe not in ours, unsafe  # every node is built from text: a job's strings cannot become markup


def test_the_wheel_ships_every_file_of_the_dashboard():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tunewright_api"]
    package = UI_DIR.parent
    files = [p.relative_to(package).as_posix() for p in UI_DIR.rglob("*") if p.is_file()]
    assert "ui/vendor/uPlot.iife.min.js" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)] == []
