"""What ``mpflow train`` says when it ends, and what it records about automatic selection.

The closing summary: iterations done and wall time, why the run stopped (all iterations, or ``--max-minutes``), the
validation loss before training → the best one (the θ saved) and where, and the benchmark verdict — training runs
none, so it says how to get one.

An operator is picked automatically for its family and d (``auto_select``) only once it was measured more accurate
than its base flow at equal compute; training compares nothing at equal compute, so every operator it saves is
``"auto_select": false`` (it serves only a stream that names it) with a note saying so and how to promote it.
"""

from __future__ import annotations

from typing import Any

#: the ``auto_select_note`` of a freshly trained operator
UNBENCHMARKED_NOTE = (
    "serves only a stream that names it: mpflow train does not compare an operator with its base flow at equal "
    "compute; set auto_select to true in config.json once a benchmark at equal wall time (mpflow evaluate: mpf "
    "against mpf-base) shows it more accurate"
)


def selection(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``auto_select`` false and :data:`UNBENCHMARKED_NOTE` (module docstring)."""
    return {**config, "auto_select": False, "auto_select_note": UNBENCHMARKED_NOTE}


def closing_summary(result: dict[str, Any], saved: str | None) -> str:
    """The lines ``mpflow train`` ends with (module docstring); ``saved``: the operator's folder (None: nothing
    saved)."""
    before, best, at = result["val_loss_untrained"], result["val_loss_best"], result["best_iteration"]
    change = (best - before) / abs(before) if before else 0.0
    rate = f", {result['it_per_s']:.2f} it/s" if result.get("it_per_s") else ""
    lines = [
        f"mpflow train: {result['iterations']} iterations in {result['seconds'] / 60:.1f} min{rate}; "
        f"stopped: {result['stopped']}",
        f"  validation loss: {before:.4f} untrained → {best:.4f} best, at iteration {at} ({change:+.3%})",
    ]
    if saved is None:
        lines.append("  saved: nothing")
    else:
        lines.append(f"  saved: {saved} (auto_select: false — it serves only a stream that names it)")
        lines.append(
            f"  benchmark: not run; mpflow evaluate --operator {saved} compares it with its base flow (mpf-base), "
            "smc and gpf"
        )
    return "\n".join(lines)


__all__ = ["UNBENCHMARKED_NOTE", "closing_summary", "selection"]
