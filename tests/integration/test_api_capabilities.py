"""Capabilities, declared once by each method (``Updater.capabilities_with``) and published: the stream document
says what its method does with the stream's options (``capabilities``), ``GET /v1/models`` says it for every method
with its defaults (and which options make a cloud weighted), and the OpenAPI schema names exactly the declared
capabilities — against a real server and Redis."""

from __future__ import annotations

from pathlib import Path

from mpflow.operators.updaters import CAPABILITIES, UPDATERS

from tests.integration.test_api_streams import GAUSS2, run

LDS = {"family": "lds", "params": {"A": [[0.9, 0.1], [0.0, 0.9]], "B": [[1.0, 0.0], [0.0, 1.0]]}}
AUTO = {"flow_fraction": "auto", "correct": True}


def test_documents_and_the_catalogue_publish_what_each_method_declares(redis_url):
    streams = {"smc": ("smc", {}), "kalman": ("kalman", {}), "mpf-auto": ("mpf", AUTO), "mpf": ("mpf", {})}

    async def body(app, client):
        docs = {}
        for stream_id, (method, options) in streams.items():
            create = {"stream_id": stream_id, "model": LDS, "prior": GAUSS2, "method": method, "seed": 2}
            r = await client.post("/v1/streams", json={**create, "method_options": options, "num_particles": 64})
            assert r.status_code == 201, r.text
            observed = await client.post(f"/v1/streams/{stream_id}/observations", json={"observations": [[0.4, 0.1]]})
            assert observed.status_code == 200, observed.text
            docs[stream_id] = (r.json(), observed.json(), (await client.get(f"/v1/streams/{stream_id}")).json())
        models = (await client.get("/v1/models")).json()
        spec = (await client.get("/openapi.json")).json()
        return docs, models, spec["components"]["schemas"]

    docs, models, schemas = run(redis_url, body)
    for stream_id, (method, options) in streams.items():
        expected = UPDATERS[method].capabilities_with(options)
        assert all(doc["capabilities"] == expected for doc in docs[stream_id]), stream_id
    assert docs["smc"][0]["capabilities"]["weighted"] and docs["mpf-auto"][0]["capabilities"]["weighted"]
    assert not docs["mpf"][0]["capabilities"]["weighted"] and docs["kalman"][0]["capabilities"]["exact"]

    assert models["methods"] == sorted(UPDATERS) == list(models["capabilities"])
    for name, entry in models["capabilities"].items():
        assert entry == UPDATERS[name].catalogue_entry()
    assert models["capabilities"]["mpf"]["weighted_with"] == {"flow_fraction": "auto"}
    assert list(schemas["Capabilities"]["properties"]) == list(CAPABILITIES)
    assert list(schemas["MethodInfo"]["properties"]) == [*CAPABILITIES, "weighted_with"]


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``heading`` whose header starts so."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_docs_api_lists_the_declared_capabilities() -> None:
    """docs/API.md "Capabilities": the meanings and the method table are the code's declarations."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
    assert _table(text, "| capability |") == [[f"`{k}`", v] for k, v in CAPABILITIES.items()]

    def cell(name: str, capability: str) -> str:
        entry = UPDATERS[name].catalogue_entry()
        if capability == "weighted" and not entry["weighted"] and entry["weighted_with"]:
            return "with " + ", ".join(f'`{k}: "{v}"`' for k, v in entry["weighted_with"].items())
        return "yes" if entry[capability] else "no"

    expected = [[f"`{n}`", *(cell(n, c) for c in CAPABILITIES)] for n in sorted(UPDATERS)]
    assert _table(text, "| method | `weighted`") == expected
