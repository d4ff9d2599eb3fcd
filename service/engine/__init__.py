"""The stream engine: from a stored state and an observation to the next state — the method a stream runs
(:mod:`.methods`, :mod:`.default_methods`, :mod:`.catalogue`), sequencing, stepping with its numerical fall-back,
micro-batching on two lanes (:mod:`.update_engine`, :mod:`.lanes`), where tensor work runs (:mod:`.tensor_work`),
what a state shows (:mod:`.summary`, :mod:`.views`) and the watchdog of the workers. Knows nothing of HTTP."""
