"""The docs hold together: the generated pages are what the generator makes now, every link in the README and
under docs/ resolves inside the repository (anchors to a heading), nothing sends the reader outside it, and the
README stays short. Each check is a helper, tested on made-up broken input as well as run on the real files."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GENERATOR = ROOT / "tools" / "gen_docs.py"
README_MAX_LINES = 200
# Places to read that lie outside the repository (another checkout's files), never to be pointed at.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|REFERENCE\.md")
# Where (c) looks for now; code docstrings are being fixed separately (see the report of the docs change).
OUTSIDE_CHECKED = ("README.md", "CONTRIBUTING.md", "docs", "api", "core", "operator", "jobs", "fitting", "tests",
                   "benchmarks", "charts", "examples", "images", "tools", "Makefile", "pyproject.toml", ".ci")

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def docs_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (a link in code is not a link)."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            lines.append("")
            continue
        lines.append("" if inside else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    one numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        match = None if inside else HEADING.match(line)
        if not match:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link's text only
        slug = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """Each link of `text` (the page `page`) that leaves the repository or names what is not there."""
    problems = []
    for target in links(text):
        where = f"{page.name}: ({target})"
        if not target:
            problems.append(f"{where}: empty link")
            continue
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            problems.append(f"{where}: points outside the repository")
            continue
        path_part, _, anchor = target.partition("#")
        if not path_part:
            if anchor not in anchors(text):
                problems.append(f"{where}: no heading #{anchor} on this page")
            continue
        if path_part.startswith("/"):
            problems.append(f"{where}: an absolute path (write it relative to the page)")
            continue
        resolved = (page.parent / path_part).resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where}: leaves the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return problems


def outside_references(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


# every text file of ours; the dated records of device calls say where they were prepared (history, not a
# pointer), and this file holds the pattern as test data
TEXT_SUFFIXES = (".md", ".txt", ".yaml", ".yml", ".py", ".sh", ".toml", ".tpl", ".json", ".js", ".html", ".cfg")
NOT_CHECKED = ("benchmarks/results", "tests/docs/test_docs.py")
SKIPPED_FOLDERS = {".git", ".venv", ".tools", ".device", ".whl-ray", "node_modules", "__pycache__", ".pytest_cache",
                   ".ruff_cache", ".hypothesis", ".mypy_cache"}


def checked_for_outside() -> list[Path]:
    files = []
    for name in OUTSIDE_CHECKED:
        path = ROOT / name
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                            and not SKIPPED_FOLDERS.intersection(p.relative_to(ROOT).parts)
                            and not str(p.relative_to(ROOT)).startswith(NOT_CHECKED)
                            and "egg-info" not in str(p))
        elif path.exists():
            files.append(path)
    return files


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs_under_test", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- (a) the generated pages are current ------------------------------------------------------------------


def test_the_generated_pages_are_current():
    """`python tools/gen_docs.py --check`, as `make docs` would run it (its own process: it builds the API)."""
    done = subprocess.run([sys.executable, str(GENERATOR), "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"run `make docs` and commit the pages:\n{done.stdout}{done.stderr}"
    for name in ("api.md", "runtime-config.md", "spec.md"):
        assert (ROOT / "docs" / name).read_text().startswith("<!-- Generated by `python tools/gen_docs.py`")


def test_the_check_names_a_stale_page_and_fails(tmp_path, monkeypatch, capsys):
    gen = load_generator()
    current, stale_page, missing = tmp_path / "current.md", tmp_path / "stale.md", tmp_path / "missing.md"
    current.write_text("same\n")
    stale_page.write_text("old\n")
    monkeypatch.setattr(gen, "render_all", lambda: {current: "same\n", stale_page: "new\n", missing: "new\n"})
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale.md is out of date" in err and "missing.md is out of date" in err and "current.md" not in err
    assert stale_page.read_text() == "old\n" and not missing.exists()  # --check writes nothing
    assert gen.main([]) == 0 and stale_page.read_text() == "new\n" and missing.read_text() == "new\n"
    assert gen.main(["--check"]) == 0


def test_the_generator_renders_bounds_and_types_as_written():
    gen = load_generator()
    assert gen.bounds({"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 10}, {}) == "> 0, ≤ 10"
    assert gen.bounds({"type": "number", "exclusiveMinimum": 0}, {}) == "> 0"
    assert gen.bounds({"enum": ["lora", "full"]}, {}) == "one of `lora`, `full`"
    assert gen.type_name({"anyOf": [{"type": "integer"}, {"type": "null"}]}, {}) == "integer"
    assert gen.type_name({"type": "object", "additionalProperties": {"type": "string"}}, {}) == "map[string]string"
    assert gen.cell("a | b <dir> `<x>`") == "a \\| b &lt;dir> `<x>`"


# --- (b) links resolve inside the repository ---------------------------------------------------------------


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# A page\n\n## The part, here (2026)\n")
    page = tmp_path / "README.md"
    text = ("[ok](docs/there.md) [ok](docs/there.md#the-part-here-2026) ![pic](docs/there.md) [gone](docs/nowhere.md) "
            "[bad anchor](docs/there.md#nope) [web](https://example.com/x) [up](../outside.md) [abs](/docs) "
            "[self](#a-heading)\n\n# A heading\n\n`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n")
    problems = broken_links(page, text, root=tmp_path)
    assert len(problems) == 5, problems
    for expected in ("nowhere.md): no such file", "#nope", "points outside", "leaves the repository", "absolute"):
        assert any(expected in p for p in problems), (expected, problems)


def test_anchors_are_githubs():
    text = "# tunewright\n## The CLI\n## Throughput: HF + PEFT, one H200 (2026-12-03)\n## The CLI\n```\n# not one\n```\n"
    assert anchors(text) == {"tunewright", "the-cli", "throughput-hf--peft-one-h200-2026-12-03", "the-cli-1"}


@pytest.mark.parametrize("page", docs_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page):
    assert broken_links(page, page.read_text()) == []


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in links(page.read_text()):
            path = target.partition("#")[0]
            if path.endswith(".md"):
                found = (page.parent / path).resolve()
                if found.is_relative_to(ROOT / "docs") and found.exists():
                    todo.append(found)
    unreached = [p.name for p in docs_pages() if p.resolve() not in {r.resolve() for r in reached}]
    assert unreached == [], "not linked from the README nor from a page it links"


# --- (c) nothing points outside the repository -----------------------------------------------------------


def test_the_outside_reference_check_finds_them():
    text = "See `../shared/DESIGN.md`.\nFormulas: REFERENCE.md.\nThe design, in docs/architecture.md.\n"
    assert outside_references(text) == ["See `../shared/DESIGN.md`.", "Formulas: REFERENCE.md."]


def test_nothing_in_the_repository_points_outside_it():
    files = checked_for_outside()
    assert README in files and any(p.parent.name == "docs" for p in files)
    found = {str(p.relative_to(ROOT)): refs for p in files if (refs := outside_references(p.read_text()))}
    assert found == {}


# --- (d) the README is short, and starts with the two commands --------------------------------------------


def test_the_readme_is_under_200_lines():
    assert len(README.read_text().splitlines()) < README_MAX_LINES


def test_the_readme_starts_with_the_two_commands_and_links_the_rest():
    text = README.read_text()
    head = "\n".join(text.splitlines()[:8])
    assert "make demo" in head and "make test" in head
    targets = {t.partition("#")[0] for t in links(text)}
    for page in ("CONTRIBUTING.md", "docs/architecture.md", "docs/api.md", "docs/spec.md", "docs/kubernetes.md"):
        assert page in targets, f"the README links {page}"
    assert "/docs" in text  # the API's own OpenAPI page on a running server
