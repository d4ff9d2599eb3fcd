"""Unknown query parameters are refused, as unknown body fields are (docs/API.md "Errors"; issue 58, item 7).

:func:`known_query_only` is a dependency that ``create_app`` gives every route it includes: on a ``/v1`` HTTP route
it compares the request's query parameters with those the route declares (its ``dependant``'s, sub-dependencies'
included) and answers 422 ``invalid_request`` naming the first unknown ones and listing the accepted ones — before,
``GET .../samples?nn=3`` answered 1000 samples. The WebSocket route (which takes ``?api_key=``), the dashboard's pages
and the OpenAPI documents (not under ``/v1``) keep their own query strings.
"""

from __future__ import annotations

from typing import Any

from mpflow.service.errors import invalid
from starlette.requests import HTTPConnection


def declared_query(route: Any) -> tuple[str, ...]:
    """The names (aliases) of the query parameters ``route`` declares, in order, sub-dependencies' included."""
    names: list[str] = []
    pending = [getattr(route, "dependant", None)]
    while pending:
        dependant = pending.pop(0)
        if dependant is None:
            continue
        names += [p.alias for p in dependant.query_params if p.alias not in names]
        pending += dependant.dependencies
    return tuple(names)


async def known_query_only(conn: HTTPConnection) -> None:
    """422 naming the query parameters this ``/v1`` route does not take (module docstring)."""
    if conn.scope["type"] != "http" or not conn.url.path.startswith("/v1/") or not conn.query_params:
        return
    route = conn.scope.get("route")
    if route is None:
        return
    accepted = declared_query(route)  # only for a request with a query string: a few list operations
    unknown = [k for k in dict.fromkeys(conn.query_params.keys()) if k not in accepted]
    if unknown:
        names = ", ".join(repr(k)[1:-1][:60] for k in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        takes = f"accepted: {', '.join(accepted)}" if accepted else "this route takes none"
        if "api_key" in unknown:  # the WebSocket's credential (never echoed); an HTTP route reads the header only
            takes += "; send the API key as 'Authorization: Bearer <key>'"
        raise invalid(f"{names}: unknown query parameter{'s' if len(unknown) > 1 else ''}; {takes}")


__all__ = ["declared_query", "known_query_only"]
