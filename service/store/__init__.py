"""The state store: streams in Redis (one server or a Cluster) with compare-and-set Lua scripts
(:mod:`.stream_store`), its connections (:mod:`.redis_conn`), tenant quotas (:mod:`.quotas`), replica health
(:mod:`.replication`) and the embedded Redis of a single-process deployment (:mod:`.embedded`)."""
