"""Completion certificates with a verifiable ID.

The ID is an HMAC-SHA256 (truncated to 128 bits) over a canonical encoding of the name, score,
total and date, keyed by a secret only the server holds: SPECLAB_CERT_SECRET if set (share it
across replicas), else a random per-install secret kept in <cache>/certificate-secret (mode 0600).
Anyone can read a certificate; only the server can make an ID that verify() accepts, so a changed
name, score, date or ID is rejected. A certificate travels as a one-line code for the "verify
certificate" page. Names are user text: length-limited, no control characters, and escaped
wherever rendered.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import html
import json
import os
import re
import secrets
import tempfile
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InputError
from engine.models import cache_root
from lessons.grading import course_score
from lessons.model import Lesson

SECRET_ENV = "SPECLAB_CERT_SECRET"
SECRET_FILE = "certificate-secret"
MIN_SECRET_CHARS = 16
MAX_NAME_CHARS = 80
MAX_TOTAL = 10_000
MAX_CODE_CHARS = 2_000
CODE_PREFIX = "SDL1."
ID_HEX = 32  # 128 bits of the HMAC
_ID = re.compile(f"[0-9a-f]{{{ID_HEX}}}")
_BIDI_CONTROLS = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


@dataclass(frozen=True)
class Certificate:
    name: str
    score: int
    total: int
    date: str  # ISO 8601, YYYY-MM-DD
    id: str  # hex HMAC of the fields above


def _check(name: object, score: object, total: object, date: object) -> None:
    """Raise InputError unless the fields are what issue() produces."""
    if not isinstance(name, str) or not name.strip():
        raise InputError("enter a name for the certificate")
    if len(name) > MAX_NAME_CHARS:
        raise InputError(f"the name is {len(name)} characters (limit {MAX_NAME_CHARS})")
    if name != name.strip() or name != unicodedata.normalize("NFC", name):
        raise InputError("the name is not in canonical form")
    if any(unicodedata.category(ch) == "Cc" or ch in _BIDI_CONTROLS for ch in name):
        raise InputError("the name may not contain control characters")
    for value, what in ((score, "score"), (total, "total")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"the {what} must be a whole number")
    if not 1 <= total <= MAX_TOTAL or not 0 <= score <= total:
        raise InputError(f"the score must be in 0..total and the total in 1..{MAX_TOTAL}")
    try:
        parsed = dt.date.fromisoformat(date) if isinstance(date, str) else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.isoformat() != date:
        raise InputError("the date must be YYYY-MM-DD")


def _canonical(name: str, score: int, total: int, date: str) -> bytes:
    fields = {"kind": "speclab-certificate", "name": name, "score": score, "total": total, "date": date}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _secret_from_file(path: Path) -> bytes:
    """The per-install secret, created on first use. It is written to a private temp file and
    hard-linked into place, so a concurrent reader never sees a half-written secret and two
    racing first starts agree on one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=SECRET_FILE + ".", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process created it first: use theirs
        finally:
            os.unlink(tmp)
    text = path.read_text(encoding="ascii").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise RuntimeError(f"{path} is not a certificate secret; delete it (earlier certificates stop verifying)")
    return bytes.fromhex(text)


def _secret() -> bytes:
    env = os.environ.get(SECRET_ENV)
    if env:
        if len(env) < MIN_SECRET_CHARS:
            raise RuntimeError(f"{SECRET_ENV} must be at least {MIN_SECRET_CHARS} characters")
        return env.encode("utf-8")
    return _secret_from_file(cache_root() / SECRET_FILE)


def _sign(name: str, score: int, total: int, date: str) -> str:
    return hmac.new(_secret(), _canonical(name, score, total, date), hashlib.sha256).hexdigest()[:ID_HEX]


def issue(name: str, score: int, total: int, date: dt.date | None = None) -> Certificate:
    """A signed certificate; date defaults to today (UTC). Raises InputError for a bad name
    (empty, too long, control characters) or score."""
    name = unicodedata.normalize("NFC", name.strip()) if isinstance(name, str) else name
    day = (date or dt.datetime.now(dt.timezone.utc).date()).isoformat()
    _check(name, score, total, day)
    return Certificate(name, score, total, day, _sign(name, score, total, day))


def verify(cert: Certificate) -> bool:
    """True only for a certificate this server issued, unchanged. Never raises for bad input."""
    try:
        _check(cert.name, cert.score, cert.total, cert.date)
    except (InputError, AttributeError):
        return False
    if not isinstance(cert.id, str) or not _ID.fullmatch(cert.id):
        return False
    return hmac.compare_digest(cert.id, _sign(cert.name, cert.score, cert.total, cert.date))


def completion_certificate(progress: object, lessons: Iterable[Lesson], name: str, date: dt.date | None = None) -> Certificate:
    """The course certificate for this progress; raises InputError until every question is answered."""
    score = course_score(progress, lessons)
    if not score.complete:
        raise InputError(f"answer every question first ({score.total - score.answered} of {score.total} left)")
    return issue(name, score.correct, score.total, date)


def to_code(cert: Certificate) -> str:
    """The certificate as one line to paste into the verify page."""
    fields = {"name": cert.name, "score": cert.score, "total": cert.total, "date": cert.date, "id": cert.id}
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return CODE_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def from_code(code: str) -> Certificate:
    """Read a pasted code; raises InputError if it is not one (verify() then says if it is genuine)."""
    bad = InputError("this is not a certificate code")
    if not isinstance(code, str) or len(code) > MAX_CODE_CHARS:
        raise bad
    code = "".join(code.split())
    if not code.startswith(CODE_PREFIX):
        raise bad
    payload = code[len(CODE_PREFIX) :]
    try:
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError, RecursionError):
        raise bad from None
    if not isinstance(data, dict) or set(data) != {"name", "score", "total", "date", "id"}:
        raise bad
    return Certificate(data["name"], data["score"], data["total"], data["date"], data["id"])


def certificate_html(cert: Certificate) -> str:
    """The certificate as an HTML fragment; every field is escaped (names are user text)."""

    def e(value: object) -> str:
        return html.escape(str(value), quote=True)

    return (
        '<div class="speclab-certificate">'
        "<h2>Speculative Decoding Lab</h2>"
        "<p>This certifies that</p>"
        f'<p class="speclab-certificate-name"><strong>{e(cert.name)}</strong></p>'
        f"<p>completed the course with a score of {e(cert.score)} / {e(cert.total)} on {e(cert.date)}.</p>"
        f'<p class="speclab-certificate-id">Certificate ID: <code>{e(cert.id)}</code></p>'
        f'<p class="speclab-certificate-code">Verification code: <code>{e(to_code(cert))}</code></p>'
        "</div>"
    )
