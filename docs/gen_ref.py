"""MkDocs hook: the pages that are generated from the code, so that they cannot drift from it.

- reference/spec.md: every field of every spec model (plait.spec), walked from `Spec`: path, type,
  default, constraints and the field's own description.
- reference/cli.md: every `plait` command and `plait bench` entry, from the argparse parser the CLI runs.
- reference/code-map.md: every module under src/plait with the first paragraph of its docstring.
- benchmarks/index.md: the benchmarks (`plait bench` entries and the project's suite in benchmarks/), each
  with its one-line help; then one page per results file (benchmarks/results/*.json, each with the
  command that made it and the machine's load) and the dated reports (benchmarks/reports/*.md).

Pages that link to files of the repository outside docs/ (tests, examples, benchmarks) keep the path as
code: a site has no such page, and tests/project/test_docs.py checks that every such path exists.
mkdocs.yml runs this file (`hooks:`); `python docs/gen_ref.py OUT` writes the pages to OUT instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ----- spec reference ---------------------------------------------------------------------------------
def _models_in(annotation) -> list[tuple[type, str]]:
    """Pydantic models inside an annotation, with the path suffix their fields take ('[]' in a list)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin, found = typing.get_origin(annotation), []
    for arg in typing.get_args(annotation):
        suffix = "[]" if origin in (list, tuple, set) else ".*" if origin is dict else ""
        found += [(m, suffix + s) for m, s in _models_in(arg)]
    return found


def _type_name(annotation) -> str:
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{typing.get_origin(annotation).__name__}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "see below" if isinstance(value, BaseModel) else f"`{value!r}`"
    return "unset" if field.default is None else f"`{field.default!r}`" if field.default is not PydanticUndefined else ""


def _constraints(field) -> str:
    parts = []
    for item in field.metadata:
        for name, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥"),
                           ("pattern", "matches")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{sign} `{value}`")
    return ", ".join(parts)


def spec_fields(model=None, prefix: str = "", seen: set | None = None) -> list[dict]:
    """Every field of `model` (default: plait.spec.Spec) and of the models nested in it, depth first."""
    from plait.spec import Spec

    model, seen = model or Spec, seen if seen is not None else set()
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append({"path": path, "model": model.__name__, "name": name, "type": _type_name(field.annotation),
                     "default": _default(field), "constraints": _constraints(field),
                     "description": (field.description or "").replace("\n", " ")})
        for nested, suffix in _models_in(field.annotation):
            if (nested, path) not in seen:
                seen.add((nested, path))
                rows += spec_fields(nested, f"{path}{suffix}.", seen)
    return rows


def spec_page() -> str:
    from plait.spec import Spec

    out = ["# Spec reference", "",
           "Generated from the pydantic models in `src/plait/spec.py` (every field, its type, default, "
           "constraints and description). Unknown fields are errors: a typo fails at load time with its path. "
           "A path with `[]` is a field of each list item, `.*` of each mapping value.", ""]
    sections: dict[str, list[dict]] = {}
    for row in spec_fields(Spec):
        top = row["path"].split(".")[0].split("[")[0]
        sections.setdefault(top, []).append(row)
    for top, rows in sections.items():
        out += [f"## `{top}`", ""]
        model = next((m for m, _ in _models_in(Spec.model_fields[top].annotation)), None)
        if model is not None and model.__doc__:
            out += [model.__doc__.strip().split("\n\n")[0].replace("\n", " "), ""]
        out += ["| field | type | default | constraints | meaning |", "|---|---|---|---|---|"]
        for r in rows:
            cells = [f"`{r['path']}`", r["type"], r["default"], r["constraints"], r["description"]]
            out.append("| " + " | ".join(c.replace("|", "\\|") if i != 1 else c for i, c in enumerate(cells)) + " |")
        out.append("")
    return "\n".join(out)


# ----- CLI reference ----------------------------------------------------------------------------------
def command_parsers(modules: dict[str, str], prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """One parser per command module, built as `plait.cli.add_commands` builds it (HELP, DESCRIPTION,
    add_arguments); a module that is not installed is left out, as the CLI leaves it out."""
    out = []
    for name, module_name in modules.items():
        try:
            mod = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        p = argparse.ArgumentParser(prog=f"{prefix} {name}", description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        out.append((f"{prefix} {name}", p))
    return out


def cli_page() -> str:
    from plait.cli import BENCH_MODULES, COMMAND_MODULES, build_parser

    out = ["# CLI reference", "", "Generated from the argparse parsers of the `plait` commands (`src/plait/cli/`). "
           "Every command also answers `--help`.", "", "```text", build_parser().format_help().rstrip(), "```", ""]
    for name, p in command_parsers(COMMAND_MODULES, "plait"):
        out += [f"## `{name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    out += ["## `plait bench`", "", "Benchmarks on your own data and machine; the project's suite is "
            "[`benchmarks/`](../benchmarks/index.md).", ""]
    for name, p in command_parsers(BENCH_MODULES, "plait bench"):
        out += [f"### `{name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# ----- code map ---------------------------------------------------------------------------------------
def _summary(path: Path) -> str:
    """The first sentence of a module's docstring (read with ast: nothing is imported)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|")


def code_map_page() -> str:
    src = ROOT / "src" / "plait"
    out = ["# Code map", "", "Generated from the modules' docstrings under `src/plait/` (every module, its first "
           "paragraph). Read top-down: the spec, then the roles, then how a runtime wires them. Import rules: "
           "the import-linter contracts in `pyproject.toml`, checked by `tests/project/test_architecture.py`.", ""]
    for folder in [src, *sorted(p for p in src.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        modules = sorted(folder.glob("*.py"))
        if not modules:
            continue
        package = folder.relative_to(src.parent).as_posix()
        out += [f"## `{package}/`", "", "| module | what it is |", "|---|---|"]
        out += [f"| `{m.name}` | {_summary(m)} |" for m in modules]
        out.append("")
    return "\n".join(out)


# ----- benchmarks ---------------------------------------------------------------------------------------
SUITE = ROOT / "benchmarks"


def suite_modules() -> list[str]:
    return sorted(p.stem for p in SUITE.glob("*.py")
                  if p.stem not in ("__init__", "common") and "HELP =" in p.read_text())


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=str)
        return f"`{text[:80]}…`" if len(text) > 80 else f"`{text}`"
    return str(value).replace("|", "\\|").replace("\n", " ")


def result_page(path: Path) -> str:
    data = json.loads(path.read_text())
    run = data.get("run", {}) if isinstance(data, dict) else {}
    out = [f"# Results: `{path.stem}`", "", f"From `benchmarks/results/{path.name}`.", ""]
    out += ["```bash", run.get("command", "(command not recorded)"), "```", ""]
    if run:
        out += [f"Recorded {run.get('recorded_at', '?')} on {run.get('cpus', '?')} CPUs, load average "
                f"{run.get('loadavg_start')} at the start and {run.get('loadavg_end')} at the end.", ""]
    body = {k: v for k, v in data.items() if k != "run"} if isinstance(data, dict) else {"rows": data}
    for key, value in body.items():  # {case: {figure: value}} reads as rows too
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            body[key] = [{key: name, **row} for name, row in value.items()]
    scalars = {k: v for k, v in body.items() if not isinstance(v, list) or not v or not isinstance(v[0], dict)}
    if scalars:
        out += ["| figure | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in scalars.items()] + [""]
    for key, rows in body.items():
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            cols = list(dict.fromkeys(c for r in rows for c in r if not isinstance(r[c], (dict, list))))
            out += [f"## {key}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows] + [""]
    return "\n".join(out)


def benchmarks_index(results: list[Path], reports: list[Path]) -> str:
    from plait.cli import BENCH_MODULES

    out = ["# Benchmarks", "", "Every benchmark reports a ratio against a baseline measured in the same run.", "",
           "## On your own data and machine: `plait bench`", "", "| command | measures |", "|---|---|"]
    for name, module_name in BENCH_MODULES.items():
        try:
            help_text = importlib.import_module(module_name).HELP
        except ModuleNotFoundError:
            continue
        out.append(f"| `plait bench {name}` | {help_text} |")
    out += ["", "## The project's measurement suite: `benchmarks/`", "",
            "Run from the repository root; each has `--help` and writes its figures with `--json PATH` "
            "(the command line and the machine's load average are recorded with them).", "",
            "| command | measures |", "|---|---|"]
    for name in suite_modules():
        out.append(f"| `python -m benchmarks.{name}` | {importlib.import_module(f'benchmarks.{name}').HELP} |")
    out += ["", "## Results", ""]
    out += [f"- [`{p.stem}`](results/{p.stem}.md)" for p in results] or ["None recorded yet."]
    out += ["", "## Dated reports", ""] + [f"- [{p.stem}](reports/{p.stem}.md)" for p in reports] + [""]
    return "\n".join(out)


def generated_pages() -> dict[str, str]:
    """site path -> Markdown of every generated page."""
    if str(ROOT) not in sys.path:  # the benchmarks package lives at the repository's top level (MkDocs
        sys.path.insert(0, str(ROOT))  # restores sys.path after loading a hook, so this is done per call)
    results = sorted((SUITE / "results").glob("*.json"))
    reports = sorted((SUITE / "reports").glob("*.md"))
    pages = {"reference/spec.md": spec_page(), "reference/cli.md": cli_page(), "reference/code-map.md": code_map_page(),
             "benchmarks/index.md": benchmarks_index(results, reports)}
    pages.update({f"benchmarks/results/{p.stem}.md": result_page(p) for p in results})
    docs_dir = ROOT / "docs"
    pages.update({f"benchmarks/reports/{p.name}": repo_links_as_code(
        p.read_text(), p.parent, docs_dir, site_dir=docs_dir / "benchmarks" / "reports") for p in reports})
    return pages


# ----- links to the repository ------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")
IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")


def repo_links_as_code(markdown: str, page_dir: Path, docs_dir: Path, site_dir: Path | None = None) -> str:
    """[text](../tests/x.py) -> `tests/x.py` (text): a link that leaves docs/ names a repository file.

    `site_dir`: where the page sits in the site when that is not `page_dir` (a dated report is written in
    benchmarks/reports/ and published under docs/benchmarks/reports/): its links into docs/ are made relative
    to where the site puts it."""

    def swap(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            return m.group(0)
        resolved = (page_dir / target).resolve()
        if resolved.is_relative_to(docs_dir.resolve()):
            if site_dir is None:
                return m.group(0)
            moved = Path(os.path.relpath(resolved, site_dir.resolve())).as_posix()
            return f"[{m.group(1)}]({moved}{m.group(3) or ''})"
        rel = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else Path(target)
        text = m.group(1).strip("`")
        return f"`{rel.as_posix()}`" if text == rel.as_posix() or text == target else f"{m.group(1)} (`{rel.as_posix()}`)"

    markdown = LINK.sub(swap, markdown)
    if site_dir is None:
        return markdown

    def move_image(m: re.Match) -> str:  # a picture of docs/ shown by a page the site publishes elsewhere
        resolved = (page_dir / m.group(2)).resolve()
        if re.match(r"^[a-z]+:", m.group(2)) or not resolved.is_relative_to(docs_dir.resolve()):
            return m.group(0)
        return f"![{m.group(1)}]({Path(os.path.relpath(resolved, site_dir.resolve())).as_posix()})"

    return IMAGE.sub(move_image, markdown)


# ----- MkDocs hooks -------------------------------------------------------------------------------------
def on_files(files, config):
    from mkdocs.structure.files import File

    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"])
    page_dir = (docs_dir / page.file.src_uri).parent
    if page.file.generated_by:  # generated pages sit in the site's tree, not in docs/
        return markdown
    return repo_links_as_code(markdown, page_dir, docs_dir)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "generated-docs")
    for rel, text in generated_pages().items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    print(f"{len(generated_pages())} pages written under {out}")
