"""The mkdocs hooks of the documentation site (mkdocs.yml, ``make docs``): pages generated at build time.

Nothing here is copied by hand, so the site cannot drift from the code:

* ``tutorial/getting-started.md`` — the README's introduction and tour, its links rewritten for the site;
* ``how-to/*.md`` — each of ``examples/`` (the scripts' docstrings and sources, the READMEs);
* ``reference/cli.md`` — ``mpflow --help`` and each command's ``--help``, from the argparse parsers
  (:func:`mpflow.cli.main.build_parser`);
* ``reference/openapi.json`` and ``reference/rest.md`` — the OpenAPI document of
  ``mpflow.service.app.create_app().openapi()`` and a table of its operations (no JavaScript, no CDN);
* ``repo/...`` — the files of the repository outside docs/ that a page links to (``../benchmarks/results/x.png``
  works on GitHub): copied into the site and the links pointed at the copies. A link to a file that does not
  exist is left as it is, and ``mkdocs build --strict`` fails on it.

Also, on every page: the Sphinx roles of the docstrings (``:meth:`x```) are shown as their code alone.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
HTTP_METHODS = ("get", "put", "post", "patch", "delete", "head", "options")
#: the README's sections the tutorial takes: everything from the introduction to "Learn more" (excluded)
README_END = "## Learn more"

#: how-to pages: (site path, title, the example's files)
EXAMPLE_PAGES = (
    ("how-to/track-a-target.md", "Track a moving target", ("track_target.py",)),
    ("how-to/irregular-times.md", "Filter fixes at irregular times, with gaps, and forecast", ("track_irregular.py",)),
    ("how-to/anomaly-score.md", "Score readings and flag an anomaly with p-values", ("anomaly_score.py",)),
    ("how-to/learn-noise.md", "Learn a linear model's noise variance R", ("learn_noise.py",)),
    ("how-to/unknown-parameters.md", "Learn unknown model parameters from a data file", ("sv_gbp_usd.py",)),
    ("how-to/smooth-fixed-lag.md", "Smooth with a fixed lag", ("smooth_fixed_lag.py",)),
    (
        "how-to/plugin-family.md",
        "Add your own model family (a plugin)",
        ("plugin_family/README.md", "plugin_family/pyproject.toml", "plugin_family/mpflow_example_family/__init__.py"),
    ),
    ("how-to/example-data.md", "Example data", ("datasets/README.md", "models/sv_gbp_usd.json")),
)


# -- the tutorial -----------------------------------------------------------------------------------------------------


def _site_link(target: str) -> str:
    """A README link target as the site's tutorial page (tutorial/) reaches it."""
    if target.startswith(("http://", "https://", "#")):
        return target
    if target.startswith("docs/"):
        return "../" + target.removeprefix("docs/")
    if target == "service/dashboard/screenshot.png":
        return "../assets/dashboard.png"
    return target


def tutorial_page() -> str:
    """The README from its first line to "Learn more", its links rewritten for the site."""
    text = (ROOT / "README.md").read_text()
    text = text.split(README_END, 1)[0]
    text = re.sub(r"\]\(([^)\s]+)\)", lambda m: "](" + _site_link(m.group(1)) + ")", text)
    text = text.replace("# mpflow\n", "# Getting started\n", 1)
    note = (
        "*This page is the README's tour (generated from README.md). Next: the "
        "[how-to guides](../how-to/track-a-target.md), the [reference](../API.md) and the "
        "[explanations](../DESIGN.md).*\n\n"
    )
    head, rest = text.split("\n", 1)
    return f"{head}\n\n{note}{rest}"


# -- the how-to pages -------------------------------------------------------------------------------------------------


def _fence(text: str, lang: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```\n"


def example_page(title: str, names: tuple[str, ...]) -> str:
    """A how-to page from ``examples/``: a README as it is, a script's docstring then its source."""
    out = [f"# {title}\n"]
    for name in names:
        path = EXAMPLES / name
        text = path.read_text()
        if path.suffix == ".md":
            body = re.sub(r"^# .*\n", "", text, count=1) if not out[1:] else text
            out.append(body)
        elif path.suffix == ".py":
            doc = re.match(r'"""(.*?)"""', text, re.S)
            if doc and len(names) == 1:
                lines = doc.group(1).strip().split("\n")
                # the docstring's "::" literal blocks are rst: indented lines become a code block here
                out.append(re.sub(r"::\n", ":\n", "\n".join(lines)) + "\n")
            out.append(f"## `examples/{name}`\n\n" + _fence(text, "python"))
        else:
            out.append(f"## `examples/{name}`\n\n" + _fence(text, "json" if path.suffix == ".json" else "toml"))
    return "\n".join(out)


# -- the CLI reference ------------------------------------------------------------------------------------------------


def cli_page() -> str:
    """``mpflow --help`` and each command's ``--help``, as argparse prints them."""
    commands = importlib.import_module("mpflow.cli.main")  # the module: mpflow.cli's ``main`` is its function

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal's width: the same page on every machine
    try:
        out = [
            "# Command line: `mpflow`\n",
            "*Generated from the argparse parsers of `mpflow/cli` (`mpflow --help`, `mpflow COMMAND --help`).*\n",
            _fence(commands.build_parser().format_help(), "text"),
        ]
        for name in commands.COMMANDS:
            parser = commands.build_parser(name)
            sub = next(a for a in parser._actions if a.dest == "command")  # the subparsers action
            out.append(f"## `mpflow {name}`\n\n{commands.COMMANDS[name].capitalize()}.\n\n")
            out.append(_fence(sub.choices[name].format_help(), "text"))
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(out)


# -- the REST reference -----------------------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    from mpflow.service.app import create_app

    return create_app().openapi()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_name(schema: dict[str, Any] | None) -> str:
    if not schema:
        return ""
    if "$ref" in schema:
        return "`" + schema["$ref"].rsplit("/", 1)[-1] + "`"
    if schema.get("type") == "array" and "items" in schema:
        return _schema_name(schema["items"]) + " [ ]"
    return "`" + str(schema.get("type", "object")) + "`"


def rest_page(spec: dict[str, Any]) -> str:
    """The operations of the OpenAPI document as tables: one row per operation, then each one's parameters."""
    info = spec.get("info", {})
    out = [
        "# REST API (OpenAPI)\n",
        f"*Generated from the service's OpenAPI document ({info.get('title', '')} {info.get('version', '')}, "
        "`mpflow.service.app.create_app().openapi()`): the whole document is [openapi.json](openapi.json); "
        "a running server also serves it at `/openapi.json`, with Swagger UI at `/docs`. The routes in prose, "
        "with every field, error code and limit: [API.md](../API.md).*\n",
        "| method | path | summary |",
        "|---|---|---|",
    ]
    operations = []
    for path, item in spec.get("paths", {}).items():
        for method in HTTP_METHODS:
            if method in item:
                operations.append((path, method, item[method]))
    for path, method, op in operations:
        anchor = op.get("operationId", f"{method}-{path}")
        summary = op.get("summary") or (op.get("description") or "").split("\n")[0]
        out.append(f"| `{method.upper()}` | [`{path}`](#{_slug(anchor)}) | {_cell(summary)} |")
    out.append("")
    for path, method, op in operations:
        anchor = _slug(op.get("operationId", f"{method}-{path}"))
        out.append(f"## `{method.upper()} {path}` {{ #{anchor} }}\n")
        if op.get("description"):
            out.append(op["description"].strip() + "\n")
        params = op.get("parameters", [])
        if params:
            out.append("| parameter | in | type | required | description |\n|---|---|---|---|---|")
            for p in params:
                out.append(
                    f"| `{p['name']}` | {p.get('in', '')} | {_schema_name(p.get('schema'))} | "
                    f"{'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
                )
            out.append("")
        body = op.get("requestBody", {}).get("content", {})
        if body:
            kinds = ", ".join(f"`{k}` {_schema_name(v.get('schema'))}" for k, v in body.items())
            out.append(f"**Request body:** {kinds}\n")
        responses = op.get("responses", {})
        if responses:
            out.append("| status | description | body |\n|---|---|---|")
            for status, r in responses.items():
                content = r.get("content", {})
                kinds = ", ".join(f"`{k}` {_schema_name(v.get('schema'))}" for k, v in content.items())
                out.append(f"| {status} | {_cell(r.get('description', ''))} | {kinds} |")
            out.append("")
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out.append("## Schemas\n")
        out.append("| schema | fields |\n|---|---|")
        for name, s in sorted(schemas.items()):
            fields = ", ".join(f"`{f}`" for f in s.get("properties", {}))
            out.append(f"| `{name}` | {fields or _cell(s.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# -- the hooks --------------------------------------------------------------------------------------------------------


def on_files(files: Files, config: Any) -> Files:
    spec = openapi_document()
    generated = {
        "tutorial/getting-started.md": tutorial_page(),
        "reference/cli.md": cli_page(),
        "reference/rest.md": rest_page(spec),
        "reference/openapi.json": json.dumps(spec, indent=2),
    }
    generated.update({path: example_page(title, names) for path, title, names in EXAMPLE_PAGES})
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    screenshot = ROOT / "service" / "dashboard" / "screenshot.png"
    files.append(File.generated(config, "assets/dashboard.png", content=screenshot.read_bytes()))
    docs = Path(config["docs_dir"]).resolve()
    copied: set[Path] = set()
    for page in docs.glob("*.md"):
        for target in OUTSIDE_LINK.findall(page.read_text()):
            path = (docs / target).resolve()
            if path.is_file() and path not in copied and ROOT in path.parents:
                copied.add(path)
                files.append(File.generated(config, _repo_copy(path), content=path.read_bytes()))
    return files


#: a link from a page at docs/'s top to a file of the repository outside docs/ (``](../benchmarks/x.png)``)
OUTSIDE_LINK = re.compile(r"\]\((\.\./[^)\s#]+)")


def _repo_copy(path: Path) -> str:
    return "repo/" + path.relative_to(ROOT).as_posix()


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Links of a page at docs/'s top to repository files outside docs/ pointed at their copies (:func:`on_files`)."""
    if "/" in page.file.src_uri:
        return markdown
    docs = Path(config["docs_dir"]).resolve()

    def copy(match: re.Match[str]) -> str:
        path = (docs / match.group(1)).resolve()
        return "](" + _repo_copy(path) if path.is_file() and ROOT in path.parents else match.group(0)

    return OUTSIDE_LINK.sub(copy, markdown)


_ROLE = re.compile(r":(?:py:)?(?:meth|class|func|mod|attr|data|exc|obj|const):(<(?:code|a)\b[^>]*>)(~?)([\w.]+)")


def _role(match: re.Match[str]) -> str:
    tag, short, name = match.groups()
    return tag + (name.rsplit(".", 1)[-1] if short else name)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """On the reference pages, the docstrings' reStructuredText as Sphinx shows it: a role (``:meth:`name```,
    ``:class:`~a.b.C```) as the code it wraps (``~``: its last name only), a paragraph's ``::`` before a literal
    block as ``:``."""
    if not page.file.src_uri.startswith("reference/"):
        return html
    return _ROLE.sub(_role, html).replace("::</p>", ":</p>")
