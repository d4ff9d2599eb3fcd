"""The shipped ``linear_gaussian`` d = 2 operator as a stream runs it, on the held-out tasks of ``mpflow evaluate``
(same seed, same streams) against the exact posterior. Its likelihood is linear-Gaussian, so the updater holds the
learned residual at exactly zero and runs the exact base flow: the mean error stays within 1e-3 posterior sd at
every one of 100 steps (float32 rounding only; the residual alone used to add 0.0008–0.0015 sd), and the variance
ratios stay in [0.8, 1.25]. The full evaluation, with MMD², cross-entropy and the baselines, is ``mpflow evaluate``
(tables in the README)."""

from mpflow.operators.trained_operators import find_operator
from mpflow.training.evaluate import (
    _STREAM_METHODS,
    EVAL_SEED,
    _derived_seeds,
    held_out_tasks,
    kalman_reference,
    mpf_updater,
    run_method,
)


def test_linear_gaussian_d2_operator_is_exact_at_every_step():
    record = find_operator("linear_gaussian", 2)
    assert record is not None and record.config["architecture"].get("residual_gate") == "information"
    B, T, N = 5, 100, 256
    tasks = held_out_tasks(record, B, T)
    ref = kalman_reference(tasks, 100, EVAL_SEED)  # exact moments; the samples only feed MMD² / cross-entropy
    seeds = _derived_seeds(EVAL_SEED, _STREAM_METHODS, B)
    run = run_method("mpf", mpf_updater(record), tasks, N, seeds, ref)  # as ``mpflow evaluate`` runs it
    assert run.error is None, run.error
    errors = run.values["mean_error_sd"].mean(1)  # [T], averaged over the tasks
    ratios = run.values["var_ratio_per_dim"]  # [T, B, d]
    assert float(errors.max()) <= 1e-3, errors
    for step in (10, 50, 100):
        r = ratios[step - 1]
        assert bool(((r >= 0.8) & (r <= 1.25)).all()), (step, r)
