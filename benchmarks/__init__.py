"""Speed, accuracy and reliability measurements: ``python -m benchmarks.<name>`` (from the repository root) prints
a table and writes JSON (+ PNG) to ``benchmarks/results/`` — ``<name>-quick.*``, git-ignored, with ``--quick``.

The service benchmarks (reliability, reliability_input, service_load, service_profile) drive the server with the
test harness (``tests.harness``: servers, Redis, faults, load) and report through :mod:`benchmarks.report`."""
