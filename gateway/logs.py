"""Secrets never reach a log line: a filter that redacts passwords in URLs (redis://user:pass@,
rediss://, http://user:pass@), bearer tokens, `sk-...` keys and `api_key=`-style values, installed on
kvgate's loggers, uvicorn's and redis-py's, and on the root logger's handlers."""

from __future__ import annotations

import logging
import re

MASK = "***"
PATTERNS = (
    # userinfo of any URL: redis://:secret@host, rediss://user:secret@host, http://user:secret@host
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@"), rf"\1{MASK}@"),
    (re.compile(r"(\bbearer\s+)[^\s'\",;]+", re.IGNORECASE), rf"\1{MASK}"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{4,}"), f"sk-{MASK}"),
    (
        re.compile(
            r"(\b(?:api[_-]?key|admin[_-]?key|password|passwd|secret|access[_-]?token|token)\b['\"]?\s*[=:]\s*['\"]?)"
            r"[^\s'\",&;})\]]+",
            re.IGNORECASE,
        ),
        rf"\1{MASK}",
    ),
)
LOGGERS = ("kvgate", "uvicorn", "uvicorn.error", "uvicorn.access", "fastapi", "redis")


def redacted(text: str) -> str:
    for pattern, replacement in PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class Redact(logging.Filter):
    """Rewrites a record's message (and its traceback's text) with its secrets masked; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redacted(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redacted(record.exc_text)
        if record.stack_info:
            record.stack_info = redacted(record.stack_info)
        return True


REDACT = Redact()


def install() -> None:
    """Put the filter on every kvgate logger created so far (a logger's filter does not see its
    children's records), uvicorn's and redis-py's, and on the root logger's handlers (which see every
    record that propagates, from loggers created later too). Idempotent."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("kvgate.", "redis."))]
    for name in (*LOGGERS, *names):
        logger = logging.getLogger(name)
        if REDACT not in logger.filters:
            logger.addFilter(REDACT)
    for handler in logging.root.handlers:
        if REDACT not in handler.filters:
            handler.addFilter(REDACT)
