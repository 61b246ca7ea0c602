"""Docs that cannot drift: the site builds with `mkdocs build --strict`, the generated spec reference lists
every field of every spec model, the CLI reference every command, and every relative link of the README
and of docs/ resolves inside the repository."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def gen_ref():
    spec = importlib.util.spec_from_file_location("gen_ref", ROOT / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field path of `model` and the models its fields hold, walked here apart from the generator."""
    paths = set()
    for name, field in model.model_fields.items():
        path = prefix + name
        paths.add(path)
        stack = [(field.annotation, "")]
        while stack:
            annotation, suffix = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                paths |= model_paths(annotation, f"{path}{suffix}.")
                continue
            origin = typing.get_origin(annotation)
            for arg in typing.get_args(annotation):
                stack.append((arg, suffix + ("[]" if origin is list else ".*" if origin is dict else "")))
    return paths


def test_spec_reference_lists_every_field_of_every_spec_model():
    from plait import spec as spec_module

    page = gen_ref().spec_page()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    expected = model_paths(spec_module.Spec)
    assert expected - listed == set(), "fields missing from the spec reference"
    assert listed - expected == set(), "the spec reference lists fields the models do not have"
    # every model of the spec module is part of the Spec, so the walk above covered each one's fields
    models = {m.__name__ for m in vars(spec_module).values() if isinstance(m, type) and issubclass(m, BaseModel)
              and m.__module__ == spec_module.__name__ and m.model_fields}
    assert models - {row["model"] for row in gen_ref().spec_fields()} == set()


def test_cli_reference_lists_every_command_and_bench():
    from plait.cli import BENCH_MODULES, COMMAND_MODULES

    page = gen_ref().cli_page()
    for name in COMMAND_MODULES:
        assert f"## `plait {name}`" in page, name
    for name, module in BENCH_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            assert f"### `plait bench {name}`" in page, name


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_of_the_readme_and_the_docs_resolves_inside_the_repository():
    generated = {(ROOT / "docs" / rel).resolve() for rel in gen_ref().generated_pages()}
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = []
    for path in files:
        for target in relative_links(path):
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not (resolved.exists() or resolved in generated):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []
    assert relative_links(ROOT / "README.md"), "the README links into the docs"


PAGE_LINES = 150  # a page says what a user needs: the current table, how to reproduce it, what it means


def test_every_docs_page_is_at_most_150_lines():
    """History goes to dated reports under benchmarks/reports/, not into the pages."""
    pages = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs").glob("*/*.md"))
    assert len(pages) > 20
    long = {str(p.relative_to(ROOT)): n for p in pages if (n := len(p.read_text().splitlines())) > PAGE_LINES}
    assert long == {}


def test_links_that_leave_the_docs_become_repository_paths():
    docs = ROOT / "docs"
    text = "[the test](../tests/project/test_docs.py), [a page](concepts/step.md), [web](https://x.org/a.md)"
    out = gen_ref().repo_links_as_code(text, docs, docs)
    assert out == "the test (`tests/project/test_docs.py`), [a page](concepts/step.md), [web](https://x.org/a.md)"


def mkdocs_build(config: Path, site: Path) -> tuple[int, list[str]]:
    """`mkdocs build --strict` of `config`: its exit code and every WARNING line it printed. Not `--quiet`:
    that hides the warnings and, with them, what strict mode counts."""
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = done.stdout + done.stderr
    return done.returncode, [line for line in output.splitlines() if line.startswith("WARNING")]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_mkdocs_build_strict_passes(tmp_path):
    """The site builds with no warning at all (warnings are errors)."""
    code, warnings = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert warnings == []
    assert code == 0
    site = tmp_path / "site"
    for page in ("reference/spec/index.html", "reference/cli/index.html", "benchmarks/index.html",
                 "concepts/design/index.html", "benchmarks/reports/2026-12-03/index.html"):
        assert (site / page).exists(), page
    assert "sources[].buffer_mb" in (site / "reference/spec/index.html").read_text()


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_mkdocs_check_fails_on_a_page_that_links_to_a_missing_file(tmp_path):
    """The check above can fail: the project's validation settings, on a fixture site with one broken link."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a page](page.md)\n")
    (docs / "page.md").write_text("# Page\n\nSee [the missing page](missing.md).\n")
    fixture = {"site_name": "fixture", "docs_dir": str(docs), "validation": config["validation"],
               "markdown_extensions": config["markdown_extensions"], "nav": ["index.md", "page.md"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(fixture))
    code, warnings = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert code != 0
    assert len(warnings) == 1 and "missing.md" in warnings[0]
