"""Secrets out of the logs: ``api_key=<value>`` and ``Bearer <value>``, in any case (``API_KEY=``, ``bearer``), are
replaced by ``<redacted>`` in every record (docs/DESIGN.md "Auth"; :mod:`mpflow.service.api.auth` says why).

A module of its own, importing only the standard library: ``mpflow serve``'s supervising process puts
:class:`RedactSecrets` on its log handler (:func:`mpflow.cli.serve.log_config`) without loading the API (and torch,
2.8 s) that only its workers run.
"""

from __future__ import annotations

import logging
import re

# a key in a query string (api_key=..., also percent-encoded as api%5Fkey) or after a Bearer scheme, in any case
# (?API_KEY=... reaches the logs as sent: issue 34, item 10)
_SECRET = re.compile(r"((?i:api_key|api%5fkey)=)[^&\s\"'#]*|((?i:\bbearer)\s+)[^\s\"',;]+")
#: loggers that may print request lines (uvicorn) or request data (mpflow); filters act on the logger they sit on
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "mpflow", "mpflow.access", "mpflow.errors", "mpflow.app")
REDACTED = "<redacted>"


def redact(text: str) -> str:
    """``text`` with every query-string API key and bearer token replaced by ``<redacted>``."""
    return _SECRET.sub(lambda m: (m.group(1) or m.group(2)) + REDACTED, text)


class RedactSecrets(logging.Filter):
    """Rewrites a record whose formatted message carries an API key (see :func:`redact`); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler to report
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def redact_secrets_in_logs(names: tuple[str, ...] = LOGGERS) -> None:
    """Put one :class:`RedactSecrets` on each named logger (idempotent). A logger's filter does not see what
    its child loggers propagate to it: ``mpflow serve`` also puts the filter on its log handler
    (:func:`mpflow.cli.serve.log_config`), which sees every record it writes."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


__all__ = ["LOGGERS", "REDACTED", "RedactSecrets", "redact", "redact_secrets_in_logs"]
