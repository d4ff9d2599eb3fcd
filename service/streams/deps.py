"""What the stream service's parts share — the settings, the store, the update engine and its tensor-work
placement, the methods, the stepper, the tenant quotas, the reads of stored states — built once per app by
:class:`~mpflow.service.streams.service.StreamService` and handed to each part whole.

A part (:class:`StreamPart`: observations, forecasts, smoothing, snapshots) takes one :class:`StreamDeps` and reads
what it needs off it (``self.settings``, ``self.store``, ...), so that adding a dependency, or a part, changes this
module and the part, not every constructor and its call (the HTTP layer's counterpart is
:mod:`mpflow.service.api.deps`)."""

from __future__ import annotations

from dataclasses import dataclass

from mpflow.service.engine.methods import Methods
from mpflow.service.engine.stepping import Stepper
from mpflow.service.engine.tensor_work import TensorWork
from mpflow.service.engine.update_engine import UpdateEngine
from mpflow.service.settings import Settings
from mpflow.service.store.quotas import TenantUsage
from mpflow.service.store.stream_store import StreamStore
from mpflow.service.streams.state_reads import StateReads


@dataclass(frozen=True)
class StreamDeps:
    settings: Settings
    store: StreamStore
    engine: UpdateEngine
    methods: Methods
    work: TensorWork
    stepper: Stepper
    usage: TenantUsage
    reads: StateReads


class StreamPart:
    """A part of the stream service: its dependencies are the fields of the :class:`StreamDeps` it was built with,
    copied to plain attributes (read on every request: an attribute, not a property call)."""

    def __init__(self, deps: StreamDeps) -> None:
        self.deps = deps
        self.settings: Settings = deps.settings
        self.store: StreamStore = deps.store
        self.engine: UpdateEngine = deps.engine
        self.methods: Methods = deps.methods
        self.work: TensorWork = deps.work
        self.stepper: Stepper = deps.stepper
        self.usage: TenantUsage = deps.usage
        self.reads: StateReads = deps.reads


__all__ = ["StreamDeps", "StreamPart"]
