"""The reliability benchmark's tables and figure (:mod:`benchmarks.reliability`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import figure, markdown_table
from tests.harness.soak import TARGETS, WARMUP_FRACTION

FAULT_COLUMNS = (
    "scenario",
    "acked",
    "stored",
    "lost",
    "ref. mismatch",
    "503",
    "503 w/o Retry-After",
    "other 5xx",
    "transport err.",
    "duplicates",
    "resumes",
    "503 then applied",
    "outage s",
    "restart/recovery s",
    "next update ok",
)


def fault_row(r: dict[str, Any]) -> list[Any]:
    return [
        r["scenario"],
        r["acknowledged"],
        r["stored"],
        r["lost"],
        r["reference_mismatches"],
        r["http_503"],
        r["http_503_without_retry_after"],
        r["http_5xx_other"],
        r["transport_errors"],
        r["duplicates"],
        r["resumes"],
        r["applied_after_503"],
        r["outage_s"],
        r.get("restart_s", r.get("recovery_s")),
        f"{r['streams'] - r['next_update_failures']}/{r['streams']}",
    ]


def format_fault_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(FAULT_COLUMNS, map(fault_row, rows), "l" + "r" * (len(FAULT_COLUMNS) - 1))


def format_soak(s: dict[str, Any]) -> str:
    rss, lat, mem = s["rss"], s["latency"], s["redis_memory"]
    t = s["targets"]
    rows = [
        ("streams × steps", f"{s['streams']} × {s['steps']} ({s['method']} {s['operator']}, N={s['num_particles']})"),
        ("updates acknowledged / stored steps ok", f"{s['updates']} / {s['stored_steps_ok']} streams"),
        ("wall, updates/s", f"{s['wall_s']} s, {s['updates_per_s']}"),
        (
            "errors (5xx, transport, client)",
            f"{s['http_503'] + s['http_5xx_other']}, {s['transport_errors']}, {sum(s['client_errors'].values())}",
        ),
        (
            "server RSS after warm-up → end (max)",
            f"{rss['rss_after_warmup_mb']} → {rss['rss_end_mb']} MiB ({rss['rss_max_mb']})",
        ),
        (
            "RSS growth after warm-up",
            f"{rss['rss_growth'] * 100:.1f} % (≤ {t['rss_growth_le'] * 100:.0f} %: "
            f"{'met' if t['rss_flat'] else 'NOT met'}); slope {rss['rss_slope_bytes_per_update']} B/update",
        ),
        (
            "p99 first 10 % → last 10 %",
            f"{lat['p99_first10_ms']} → {lat['p99_last10_ms']} ms (×"
            f"{lat['p99_ratio_last_first']}, ≤ {t['p99_ratio_le']}: {'met' if t['p99_stable'] else 'NOT met'})",
        ),
        ("p50 / p99 overall", f"{lat['p50_ms']} / {lat['p99_ms']} ms"),
        (
            "state bytes: computed from N, d / stored (STRLEN)",
            f"{mem['expected_state_bytes']} / "
            f"{mem['state_strlen_final']} ({'equal' if t['state_bytes_as_computed'] else 'DIFFERENT'})",
        ),
        (
            "Redis MEMORY USAGE per stream: state + meta",
            f"{mem['state_memory_usage_mean']} + {mem['meta_memory_usage_mean']} = {mem['per_stream_keys_bytes']} B",
        ),
        (
            "Redis used_memory per stream: created → end (dataset only)",
            f"{mem['used_memory_per_stream_created']} → {mem['used_memory_per_stream_final']} B "
            f"({mem['dataset_per_stream_created']} → {mem['dataset_per_stream_final']} B; client buffers at end "
            f"{mem['client_buffers_final'] / 2**20:.1f} MiB in all)",
        ),
        ("AOF size at end", f"{s['aof_bytes_end'] / 2**20:.1f} MiB"),
        ("load average (1 min) mean / max during the soak", f"{s['load1_mean']} / {s['load1_max']}"),
    ]
    return markdown_table(("soak", "measured"), rows)


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS and Redis memory against time, and request latency against time (rolling p50/p99) of the soak."""
    s = result["soak"]
    samples = s["series"]["samples"]
    lat = s["series"]["latency_windows"]
    with figure(path, 3, 1, figsize=(9, 9), sharex=True) as (fig, axes):
        t = [x["t"] for x in samples]
        axes[0].plot(t, [x["rss"] / 2**20 for x in samples], label="server RSS")
        warm = next((x for x in samples if x["updates"] >= WARMUP_FRACTION * s["updates"]), None)
        if warm is not None:
            axes[0].axvline(warm["t"], color="gray", ls=":", label="end of warm-up (10 % of updates)")
            axes[0].axhline(
                warm["rss"] * (1 + TARGETS["rss_growth"]) / 2**20,
                color="red",
                ls="--",
                lw=0.8,
                label="+10 % of RSS after warm-up",
            )
        axes[0].set_ylabel("MiB")
        axes[0].legend(fontsize=7)
        axes[1].plot(t, [x["redis_used_memory"] / 2**20 for x in samples], color="tab:green", label="Redis used_memory")
        axes[1].plot(t, [x["redis_dataset"] / 2**20 for x in samples], color="tab:olive", label="of which the dataset")
        ax2 = axes[1].twinx()
        ax2.plot(t, [x["load1"] for x in samples], color="tab:gray", lw=0.8, label="load average (1 min)")
        axes[1].set_ylabel("MiB")
        ax2.set_ylabel("load")
        axes[1].legend(loc="upper left", fontsize=7)
        ax2.legend(loc="upper right", fontsize=7)
        if lat:
            axes[2].plot([w["t"] for w in lat], [w["p50_ms"] for w in lat], label="p50")
            axes[2].plot([w["t"] for w in lat], [w["p99_ms"] for w in lat], label="p99")
            axes[2].set_yscale("log")
        axes[2].set_ylabel("latency, ms")
        axes[2].set_xlabel("seconds since the load started")
        axes[2].legend(fontsize=7)
        fig.suptitle(
            f"soak: {s['streams']} streams × {s['steps']} steps, {s['method']} N={s['num_particles']} "
            f"{s['model']['family']} d=2, embedded store; {result['meta']['machine_cores']} cores",
            fontsize=9,
        )
        fig.tight_layout()
