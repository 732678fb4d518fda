"""Who may use the web app and which folders it may touch: one policy, checked on every request.

- Bound to a loopback address (127.0.0.1, ::1, localhost) it answers anyone on this machine; bound to any other
  address every request needs the token (``Authorization: Bearer TOKEN``, or ``?token=TOKEN`` for the pages and
  the event stream, which a browser cannot give a header), else 401. A request that brought a good token in its
  URL gets it back as a cookie (HttpOnly, SameSite=Strict), which the page's own script, style and image requests
  then carry; no other site's page can make the browser send it.
- A state-changing request is a POST whose ``Origin``, when a browser sends one, is the app's own (a page on
  another site cannot start or stop a run through this user's browser), else 403.
- Paths (dataset folders, model files, the folder browser) must resolve, symlinks followed and ``..`` collapsed,
  inside one of the allowed roots (``--allow-dir``; default: the home folder and the current folder), else 403.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK_NAMES = ("localhost",)


class Refused(Exception):
    """A request the policy refuses: ``status`` (401, 403) and one line saying what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


TOKEN_COOKIE = "autotune_token"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class AccessPolicy:
    host: str
    port: int
    token: str | None  # None: loopback without a token
    allowed_roots: tuple[Path, ...] = field(default_factory=tuple)

    @classmethod
    def for_server(cls, host: str, port: int, token: str | None, allow_dirs: list[str] | None) -> AccessPolicy:
        """The policy of ``autotune ui``: a token when not on loopback (generated unless given)."""
        if token is None and not is_loopback(host):
            token = new_token()
        roots = [Path(p) for p in allow_dirs] if allow_dirs else [Path.home(), Path.cwd()]
        return cls(host=host, port=port, token=token,
                   allowed_roots=tuple(dict.fromkeys(root.expanduser().resolve() for root in roots)))

    def check_token(self, header: str | None, query: str | None, cookie: str | None = None) -> None:
        if self.token is None:
            return
        given = (header or "").removeprefix("Bearer ").strip() or (query or "") or (cookie or "")
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Refused(401, "this server needs its token: send Authorization: Bearer TOKEN (printed by "
                          "autotune ui with its URL)")

    def check_origin(self, origin: str | None, host_header: str | None) -> None:
        """A browser's POST must come from this app's own pages (same scheme-less host:port)."""
        if origin is None:
            return  # not a browser (curl, scripts): the token (off loopback) is their check
        own = {f"{self.host}:{self.port}", f"localhost:{self.port}", f"127.0.0.1:{self.port}"}
        if host_header:
            own.add(host_header)
        where = origin.split("://", 1)[-1].rstrip("/")
        if where not in own:
            raise Refused(403, f"cross-origin request from {origin} refused; use the app's own page")

    def resolve(self, path: str, what: str) -> Path:
        """``path`` made absolute with symlinks followed, or 403 when it lies outside every allowed root."""
        if not path or "\x00" in path:
            raise Refused(403, f"{what}: give a path")
        resolved = Path(os.path.expanduser(path)).resolve(strict=False)
        if not any(resolved == root or root in resolved.parents for root in self.allowed_roots):
            roots = ", ".join(str(root) for root in self.allowed_roots)
            raise Refused(403, f"{what} {path}: outside the folders this server may use ({roots}); start autotune "
                          "ui with --allow-dir for another")
        return resolved
