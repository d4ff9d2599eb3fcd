"""The test harness: what tests and benchmarks use to run and drive the service, outside the shipped package.

* :mod:`~tests.harness.server` — the app in process or in a thread, ``python -m mpflow serve`` as a user runs it,
  external and embedded redis-servers, key-prefix clean-up;
* :mod:`~tests.harness.specs` — the streams and server settings the scenarios share;
* :mod:`~tests.harness.traffic` — streams fed through the client with every HTTP exchange recorded;
* :mod:`~tests.harness.verify` — exactly-once, against the float64 Kalman reference;
* :mod:`~tests.harness.faults` — store and process faults injected under load;
* :mod:`~tests.harness.soak` — the soak: memory and latency over many updates;
* :mod:`~tests.harness.hostile` — the fuzzer and the hostile bodies;
* :mod:`~tests.harness.numerics` — extreme observations for every family and method;
* :mod:`~tests.harness.load` — the closed-loop load generator.

``benchmarks/`` imports these too (``python -m benchmarks.<name>`` from the repository root), at larger sizes.
"""
