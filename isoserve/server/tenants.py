"""Tenants and their API keys, kept in a TOML file that never holds a key in clear.

    [[tenants]]
    name = "default"
    key_sha256 = "9f86d0..."
    admin = true
    created = 2026-05-09T07:35:25Z

    [tenants.limits]     # optional; see isoserve/server/backpressure.py
    max_concurrent_requests = 16   # requests in flight at once (the rest get 429)
    max_queued_tokens = 200000     # prompt + max_tokens over its requests in flight

A key is `isk-` + 32 random bytes (urlsafe base64). Such a key has far more entropy than any
password, so a plain SHA-256 is enough to make a stolen file useless; a slow KDF would only
slow every request. The store re-reads the file when it changes, so adding or removing a
tenant takes effect in a running server without a restart.
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import tempfile
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("isoserve.tenants")

KEY_PREFIX = "isk-"
_KEY_BYTES = 32
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # safe in logs, labels and file names
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# What a tenant's [tenants.limits] table may set; each a positive integer.
LIMIT_KEYS = ("max_concurrent_requests", "max_queued_tokens")
_HEADER = ("# isoserve tenants. API keys are stored only as SHA-256 hashes; a new key is shown\n"
           "# once, when `isoserve tenants add` creates it. Edit with care: the server reloads\n"
           "# this file when it changes.\n")


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: str
    admin: bool = False
    created: datetime | None = None
    limits: dict = field(default_factory=dict)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)


class TenantStore:
    def __init__(self, tenants: list[Tenant], path: Path | None = None):
        _check_unique(tenants, path)
        self.tenants = list(tenants)
        self.path = path
        self._file_id = _file_id(path) if path is not None else None

    @classmethod
    def load(cls, path: str | Path) -> TenantStore:
        path = Path(path)
        return cls(read_tenants(path), path)

    def authenticate(self, bearer_key: str) -> Tenant | None:
        """The tenant holding this key, or None. Compares every stored hash in constant time,
        so neither the answer's timing nor an early exit tells which prefix matched."""
        self._reload_if_changed()
        digest = hash_key(bearer_key)
        found = None
        for tenant in self.tenants:
            if hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        return found

    def get(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        file_id = _file_id(self.path)
        if file_id == self._file_id:
            return
        try:
            tenants = read_tenants(self.path)
            _check_unique(tenants, self.path)
        except (OSError, ValueError) as e:
            # Keep serving with the tenants we have: a half-edited file must not lock everyone out.
            log.error("tenants file %s changed but cannot be used (%s); keeping the previous "
                      "%d tenants", self.path, e, len(self.tenants))
        else:
            log.info("tenants file %s reloaded: %d tenants", self.path, len(tenants))
            self.tenants = tenants
        self._file_id = file_id


def add_tenant(path: str | Path, name: str, admin: bool = False, limits: dict | None = None) -> str:
    """Add a tenant and return its new key: the only time the key exists in clear."""
    path = Path(path)
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid tenant name {name!r}: use 1-64 letters, digits and _ . @ -, "
                         "starting with a letter or digit")
    limits = {k: v for k, v in (limits or {}).items() if v is not None}
    _check_limits(limits, f"tenant {name!r}")
    with _locked(path):
        tenants = read_tenants(path) if path.exists() else []
        if any(t.name == name for t in tenants):
            raise ValueError(f"tenant {name!r} already exists in {path}")
        key = new_key()
        created = datetime.now(timezone.utc).replace(microsecond=0)
        write_tenants(path, tenants + [Tenant(name, hash_key(key), admin, created, limits)])
    return key


def remove_tenant(path: str | Path, name: str) -> None:
    """Remove a tenant; its key stops working as soon as a server sees the new file."""
    path = Path(path)
    with _locked(path):
        tenants = read_tenants(path)
        if not any(t.name == name for t in tenants):
            raise ValueError(f"no tenant {name!r} in {path}")
        write_tenants(path, [t for t in tenants if t.name != name])


def ensure_tenants_file(path: str | Path) -> str | None:
    """On a first start, create the file with one admin tenant "default" and return its key;
    None when the file already exists."""
    path = Path(path)
    with _locked(path):
        if path.exists():
            return None
        key = new_key()
        created = datetime.now(timezone.utc).replace(microsecond=0)
        write_tenants(path, [Tenant("default", hash_key(key), True, created)])
    return key


# ---- the file --------------------------------------------------------------------------------

def read_tenants(path: Path) -> list[Tenant]:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    entries = data.get("tenants", [])
    if not isinstance(entries, list):
        raise ValueError(f"{path}: `tenants` must be an array of tables ([[tenants]])")
    return [_parse_tenant(entry, f"{path}: tenant #{i + 1}") for i, entry in enumerate(entries)]


def _parse_tenant(entry: dict, where: str) -> Tenant:
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: missing or invalid name {name!r}")
    key_hash = entry.get("key_sha256")
    if not isinstance(key_hash, str) or not _SHA256_HEX.fullmatch(key_hash):
        raise ValueError(f"{where} ({name}): key_sha256 must be 64 lowercase hex digits")
    admin = entry.get("admin", False)
    created = entry.get("created")
    limits = entry.get("limits", {})
    if not isinstance(admin, bool):
        raise ValueError(f"{where} ({name}): admin must be true or false")
    if created is not None and not isinstance(created, datetime):
        raise ValueError(f"{where} ({name}): created must be a TOML date-time")
    if not isinstance(limits, dict):
        raise ValueError(f"{where} ({name}): limits must be a table")
    _check_limits(limits, f"{where} ({name})")
    return Tenant(name, key_hash, admin, created, limits)


def _check_limits(limits: dict, where: str) -> None:
    for key, value in limits.items():
        if key not in LIMIT_KEYS:
            raise ValueError(f"{where}: unknown limit {key!r} (known: {', '.join(LIMIT_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: limit {key} must be a positive integer, got {value!r}")


def _check_unique(tenants: list[Tenant], path: Path | None) -> None:
    for attr in ("name", "key_sha256"):
        values = [getattr(t, attr) for t in tenants]
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            what = "names" if attr == "name" else "keys"
            shown = dupes if attr == "name" else [d[:8] + "..." for d in dupes]
            raise ValueError(f"{path or 'tenants'}: duplicate tenant {what}: {shown}")


def write_tenants(path: Path, tenants: list[Tenant]) -> None:
    """Replace the file in one rename: readers see the old file or the new one, never half."""
    text = _HEADER + "".join(_tenant_toml(t) for t in tenants)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _tenant_toml(t: Tenant) -> str:
    lines = ["", "[[tenants]]", f"name = {_toml_value(t.name)}",
             f"key_sha256 = {_toml_value(t.key_sha256)}", f"admin = {_toml_value(t.admin)}"]
    if t.created is not None:
        lines.append(f"created = {_toml_value(t.created)}")
    if t.limits:
        lines += ["", "[tenants.limits]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in t.limits.items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # always has a '.' or an exponent, as TOML floats need
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, str):
        return '"' + "".join(_escape_char(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} values to the tenants file")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _escape_char(c: str) -> str:
    if c in _ESCAPES:
        return _ESCAPES[c]
    if ord(c) < 0x20 or ord(c) == 0x7F:  # other control characters are not allowed raw
        return f"\\u{ord(c):04x}"
    return c


def _file_id(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@contextmanager
def _locked(path: Path):
    """Serialize writers (two `tenants add` at once would otherwise lose one tenant). The lock
    is a separate file because the tenants file itself is replaced on every write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
