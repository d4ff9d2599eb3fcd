"""The dashboard: live posteriors in the browser, served by the service itself.

* :mod:`.pages` — the page (``GET /``, ``GET /streams/{id}``) and its script and style (``static/``; plain
  canvas, no build step, no CDN);
* :mod:`.events` — ``GET /v1/streams/{id}/events``, a Server-Sent-Events feed of a stream's updates;
* :mod:`mpflow.service.streams.publish` (the stream service's side) — the other end of that feed: updates
  published through Redis as they are stored;
* :mod:`.routes` — the router ``create_app`` includes.

Nothing below the HTTP layer imports the dashboard.
"""
