"""Secrets out of everything the daemon writes: one ``redact`` for text, and its helpers for a
command line and an environment.

What counts as a secret:

* the value after ``--api-key`` (``--api-key X`` or ``--api-key=X``), and after the other vLLM
  flags that take a credential (``--hf-token``);
* the value of any environment variable whose name ends in ``_KEY`` or contains ``TOKEN``,
  ``SECRET`` or ``PASSWORD`` (``NAME=value`` in text, or an env mapping);
* any value registered with ``register_secret`` (an engine's API key read from its
  ``api_key_file``), wherever it appears.

Redaction happens where text leaves the process, never where it is made: ``RedactFilter`` sits
on every logging handler (the journal, text and JSON handlers: logs.py; the ring behind
`llm-supervisor events`: daemon/events.py), and ``redact_json`` on every JSON reply (the control
socket: control.py; the HTTP endpoints: daemon/endpoints.py; the status file: daemon/status.py)
and on sd_notify's STATUS= line (notify.py). So a reason, an exit text or a command line may
quote a secret anywhere inside the daemon and still never leave it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

MASK: Final = "***"

# vLLM flags whose value is a credential.
SECRET_FLAGS: Final = ("--api-key", "--hf-token")

_SECRET_NAME_RE: Final = re.compile(r"(?:_KEY$|TOKEN|SECRET|PASSWORD|^API_KEY$)", re.IGNORECASE)
_FLAGS_RE: Final = "|".join(re.escape(f) for f in SECRET_FLAGS)
_FLAG_RE: Final = re.compile(rf"(?P<flag>(?:{_FLAGS_RE}))(?P<sep>=|\s+)(?P<q>['\"]?)(?P<value>[^\s'\",]+)")
# NAME=value or NAME: value for secret-looking environment names (env dumps, shell-style lines).
# Upper case only: lower-case words such as "generation_tokens_total=12" are evidence, not secrets.
_ASSIGN_RE: Final = re.compile(
    r"\b(?P<name>[A-Z_][A-Z0-9_]*)(?P<sep>['\"]?(?:=|:\s*))(?P<q>['\"]?)(?P<value>[^\s'\",}]+)"
)
# "Authorization: Bearer X" in an echoed request or error.
_BEARER_RE: Final = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[^\s'\",]+)", re.IGNORECASE)
# Values too short to be a credential would mask ordinary words.
_MIN_SECRET_LEN: Final = 4

_known: set[str] = set()
_known_lock = threading.Lock()
_known_re: re.Pattern[str] | None = None


def secret_env_name(name: str) -> bool:
    """Whether an environment variable of this name holds a secret (``*_KEY``, ``*TOKEN*``,
    ``*SECRET*``, ``*PASSWORD*``)."""
    return _SECRET_NAME_RE.search(name) is not None


def register_secret(value: str) -> None:
    """Mask ``value`` wherever it appears from now on (an API key read from a file)."""
    global _known_re
    value = value.strip()
    if len(value) < _MIN_SECRET_LEN:
        return
    with _known_lock:
        if value in _known:
            return
        _known.add(value)
        # Longest first, so a key that contains another is masked whole.
        alternatives = sorted(_known, key=len, reverse=True)
        _known_re = re.compile("|".join(re.escape(v) for v in alternatives))


def _mask_assign(match: re.Match[str]) -> str:
    # "-" is the placeholder for "not set" (a reload's "env.HF_TOKEN: - -> ***"), not a secret.
    if not secret_env_name(match.group("name")) or match.group("value") in ("-", MASK):
        return match.group(0)
    return f"{match.group('name')}{match.group('sep')}{match.group('q')}{MASK}"


def redact(text: str) -> str:
    """``text`` with every secret it shows replaced by ``***``."""
    if not text:
        return text
    known = _known_re
    if known is not None:
        text = known.sub(MASK, text)
    if "--" in text:
        text = _FLAG_RE.sub(lambda m: f"{m.group('flag')}{m.group('sep')}{m.group('q')}{MASK}", text)
    if "=" in text or ":" in text:
        text = _ASSIGN_RE.sub(_mask_assign, text)
    if "earer" in text:
        text = _BEARER_RE.sub(lambda m: f"{m.group('head')}{MASK}", text)
    return text


def redact_json(value: Any) -> Any:
    """A JSON value with every string in it through ``redact`` (keys are names, not text)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(item) for item in value]
    return value


class RedactFilter(logging.Filter):
    """Every record's text through ``redact`` before the handler it sits on writes it: an
    engine's ``--api-key`` or a ``*_TOKEN`` value never reaches the journal or `llm-supervisor
    events`, whoever logged it (the spawn line, a forwarded vLLM line, a transition's reason, an
    error with a command line in it). Every handler gets one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment with secret-looking values masked."""
    return {name: MASK if secret_env_name(name) else redact(value) for name, value in env.items()}


def redact_all(lines: Iterable[str]) -> list[str]:
    return [redact(line) for line in lines]


__all__ = [
    "MASK",
    "SECRET_FLAGS",
    "RedactFilter",
    "redact",
    "redact_all",
    "redact_env",
    "redact_json",
    "register_secret",
    "secret_env_name",
]
