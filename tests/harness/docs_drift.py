"""What the documentation says against what the code has, so that the two cannot drift apart (issue 38).

* docs/API.md "Limits": every ``Settings`` field, as ``MPFLOW_<NAME>``, in a table row ``| `MPFLOW_X` | default |
  ...`` or in the "Other settings:" paragraph as ``MPFLOW_X`` (default: ...)``, with the field's default; and
  ``mpflow serve``'s own (``MPFLOW_HOST``, ``MPFLOW_PORT``, ``MPFLOW_WORKERS``) with theirs; nothing documented
  that is neither.
* docs/methods.md: its "Model families" table names every parameter of every family.
* README.md: its "Model families" table lists every registered family (``FAMILIES``) and no other, and the method
  list of its tour every registered method (``UPDATERS``).

Each checker takes the text and the code's values and returns the problems in words (empty: they agree), so a test
can feed it a deliberately altered text.
"""

from __future__ import annotations

import re
from typing import Any

_ROW = re.compile(r"^\| `MPFLOW_([A-Z0-9_]+)` \| ([^|]*?) \|", re.M)
_PROSE = re.compile(r"`MPFLOW_([A-Z0-9_]+)`\s+\(([^):]*)")
#: a documented default's words for "no value"
_NONE_WORDS = {"unset": None, "empty": ""}


def documented_settings(api_md: str) -> dict[str, str]:
    """``MPFLOW_<NAME>`` → the default docs/API.md gives it: the "Limits" tables' rows, then the "Other settings:"
    paragraph's ``(default...)`` for the rest."""
    found = {f"MPFLOW_{k}": " ".join(v.split()) for k, v in _ROW.findall(api_md)}
    start = api_md.find("Other settings:")
    if start >= 0:
        paragraph = api_md[start : api_md.find("\n\n", start)]
        for k, v in _PROSE.findall(paragraph):
            found.setdefault(f"MPFLOW_{k}", " ".join(v.split()))  # the paragraph's line breaks as spaces
    return found


def _value(text: str) -> Any:
    """A documented default as a value: its first word without backquotes (``8388608 (8 MiB)`` → 8388608)."""
    word = text.split(" ")[0].strip("`")
    if word in _NONE_WORDS:
        return _NONE_WORDS[word]
    if word in ("true", "false"):
        return word == "true"
    try:
        return float(word)
    except ValueError:
        return word


def _same(documented: str, default: Any) -> bool:
    if isinstance(default, str) and " " in default:  # a default in words (mpflow serve's workers)
        return documented == default
    value = _value(documented)
    if isinstance(default, bool) or default is None or isinstance(value, str):
        return value == ("{}" if default == {} else default) or (value == "" and default in ("", None))
    return isinstance(value, float) and value == float(default)


def settings_drift(api_md: str, settings: dict[str, Any], serve: dict[str, Any]) -> list[str]:
    """The disagreements of docs/API.md with ``settings`` (``Settings`` field → default) and ``serve``
    (``MPFLOW_*`` → default of ``mpflow serve``'s own settings)."""
    expected = {f"MPFLOW_{name.upper()}": default for name, default in settings.items()} | serve
    documented = documented_settings(api_md)
    problems = [f"{name} (default {default!r}) is not documented" for name, default in expected.items()
                if name not in documented]  # fmt: skip
    problems += [
        f"{name}: documented default {documented[name]!r}, the code's is {default!r}"
        for name, default in expected.items()
        if name in documented and not _same(documented[name], default)
    ]
    problems += [f"{name} is documented but is no setting" for name in documented if name not in expected]
    return problems


def _section(markdown: str, heading: str) -> str:
    start = markdown.index(heading)
    end = markdown.find("\n## ", start + len(heading))
    return markdown[start : end if end >= 0 else None]


def readme_drift(readme: str, families: set[str], methods: set[str]) -> list[str]:
    """The disagreements of README.md's family table and method list with the registries."""
    table = set(re.findall(r"^\| `([a-z0-9_]+)` \|", _section(readme, "## Model families"), re.M))
    problems = [f"family {f} is not in the README's table" for f in sorted(families - table)]
    problems += [f"the README's table lists {f}, which is no family" for f in sorted(table - families)]
    listed = re.search(r'`"method": ((?:"[a-z0-9_]+"(?: \| )?)+)`', readme)
    named = set(re.findall(r'"([a-z0-9_]+)"', listed.group(1))) if listed else set()
    problems += [f"method {m} is not in the README's method list" for m in sorted(methods - named)]
    problems += [f"the README's method list names {m}, which is no method" for m in sorted(named - methods)]
    return problems


def methods_md_drift(methods_md: str, parameters: dict[str, list[str]]) -> list[str]:
    """The disagreements of docs/methods.md's "Model families" table (its parameters column) with each family's
    parameters (the names of its ``spec``, :class:`mpflow.operators.models.spec.FamilySpec`) — a family without a
    row, a parameter its row does not name."""
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(
            r"^\| `([a-z0-9_]+)` \|(?:[^|]*\|){2}([^|]*)\|", _section(methods_md, "## Model families"), re.M
        )
    }
    problems = [f"family {f} has no row in docs/methods.md" for f in parameters if f not in rows]
    problems += [
        f"docs/methods.md's {f} row does not name its parameter {p}"
        for f, names in parameters.items()
        if f in rows
        for p in names
        if not re.search(rf"(?<![A-Za-z_]){re.escape(p)}(?![A-Za-z_])", rows[f])
    ]
    return problems


__all__ = ["documented_settings", "methods_md_drift", "readme_drift", "settings_drift"]
