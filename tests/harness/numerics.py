"""Numerical faults: every family and method fed extreme observations, and what was stored read back.

:func:`numerical_faults` — for every family and every method ``GET /v1/models`` lists for it, a stream fed
observations of scale ±1e6 … 3e38 (:data:`EXTREME`), one per request: the statuses, the steps that fell back
(by fall-back method, from the answers' ``"fallback"``; cross-checked against ``mpflow_update_fallbacks_total``,
:func:`fallback_counts`) and — read back through ``/particles``, the document and ``/samples`` after every
request — any non-finite value stored (:func:`all_finite`; must be 0).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.specs import FAMILIES, GAUSS2

EXTREME = [1e6, -1e6, 1e12, 1e30, -1e30, 3e38, 0.5]


def all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a decoded JSON answer (checked by the standard library's strict encoder,
    independently of the service's own guard)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def fallback_counts(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """{(family, method, fallback): count} of ``mpflow_update_fallbacks_total`` in a /metrics page."""
    return {
        (s.labels["family"], s.labels["method"], s.labels["fallback"]): s.value
        for fam in text_string_to_metric_families(metrics_text)
        if fam.name == "mpflow_update_fallbacks"
        for s in fam.samples
        if s.name == "mpflow_update_fallbacks_total"
    }


def numerical_faults(
    url: str, headers: dict[str, str] | None = None, values: list[float] | None = None
) -> dict[str, Any]:
    """Every family × method, fed ``values`` (default :data:`EXTREME`) one per request: a row per pair with
    the statuses, the fall-backs (from the answers) and the non-finite values found stored (module docstring);
    plus the fall-back counters of ``/metrics`` before and after."""
    values = EXTREME if values is None else values
    rows = []
    with httpx.Client(base_url=url, headers=headers or {}, timeout=120.0) as c:
        before = fallback_counts(c.get("/metrics").text)
        for fam in c.get("/v1/models").json()["families"]:
            family = fam["family"]
            params, obs = FAMILIES[family]
            for method in fam["methods"]:
                spec = {"model": {"family": family, "params": params}, "prior": GAUSS2, "method": method}
                r = c.post("/v1/streams", json={**spec, "num_particles": 32, "seed": 5})
                row: dict[str, Any] = {"family": family, "method": method, "requests": 0, "statuses": {}}
                row.update(fallbacks={}, non_finite_stored=0, non_finite_answers=0)
                if r.status_code != 201:
                    row["create"] = r.status_code
                    rows.append(row)
                    continue
                sid = r.json()["stream_id"]
                for v in values:
                    r = c.post(f"/v1/streams/{sid}/observations", json={"observations": [obs(v)]})
                    row["requests"] += 1
                    row["statuses"][str(r.status_code)] = row["statuses"].get(str(r.status_code), 0) + 1
                    if r.status_code == 200:
                        answer = r.json()
                        row["non_finite_answers"] += not all_finite(answer)
                        for step in answer["per_step"]:
                            if "fallback" in step:
                                row["fallbacks"][step["fallback"]] = row["fallbacks"].get(step["fallback"], 0) + 1
                    for path, params_ in ((f"/v1/streams/{sid}", None), (f"/v1/streams/{sid}/particles", None)):
                        got = c.get(path, params=params_)
                        row["non_finite_stored"] += got.status_code != 200 or not all_finite(got.json())
                    got = c.get(f"/v1/streams/{sid}/samples", params={"n": 64})
                    row["non_finite_stored"] += got.status_code != 200 or not all_finite(got.json())
                c.delete(f"/v1/streams/{sid}")
                rows.append(row)
        after = fallback_counts(c.get("/metrics").text)
    metric = {"/".join(k): after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    return {"rows": rows, "metric_increase": {k: v for k, v in metric.items() if v}}
