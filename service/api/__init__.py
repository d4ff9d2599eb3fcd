"""The HTTP surface of docs/API.md: one router per resource, the dependencies they are given
(:mod:`.deps`), the middleware (auth gate, body limit, access log and metrics), the WebSocket, the docs pages.
Handlers call :class:`~mpflow.service.streams.service.StreamService` and nothing below it."""
