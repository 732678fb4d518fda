"""Who may use the web app and which folders it may touch: one policy, checked on every request before routing.

Any web page the user opens can send requests to 127.0.0.1, and can rebind its own name to 127.0.0.1 (DNS
rebinding), so the server trusts nothing it did not start with:
- ``Host`` must name the address it bound (and, on a loopback bind, ``localhost`` / ``127.0.0.1`` / ``[::1]``) with
  its port, else 421: a rebound page's requests carry its own name. A wildcard bind (0.0.0.0, ::) answers any name
  and needs the token on every request.
- Off loopback every request needs the token (``Authorization: Bearer TOKEN``, scheme in any case as RFC 7235
  allows, or ``?token=TOKEN`` for the pages and the event stream, which a browser cannot give a header), else 401.
  A request that brought a good token in its URL gets it back as a cookie (HttpOnly, SameSite=Strict), which the
  page's own script, style and image requests then carry; no other site's page can make the browser send it.
- A state-changing request (a POST) must show where it comes from: an ``Origin`` that is one of the app's own, or,
  without one, ``Sec-Fetch-Site: same-origin`` / ``none``, or the token in its ``Authorization`` header (which no
  cross-site page can add without a CORS preflight this server never answers); everything else is 403. Scripts on
  loopback send ``Origin: http://127.0.0.1:PORT``.
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
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the names a loopback-bound server answers to
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # noqa: S104 (the binds that answer on every interface: token always)
SAFE_FETCH_SITES = ("same-origin", "none")  # Sec-Fetch-Site values of the app's own page / a typed URL


class Refused(Exception):
    """A request the policy refuses: ``status`` (401, 403, 421) and one line saying what to do."""

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


def bearer(header: str | None) -> str:
    """The credentials of an ``Authorization: Bearer X`` header (the scheme compared case-insensitively)."""
    scheme, _, credentials = (header or "").strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


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

    def own_hosts(self) -> set[str]:
        """The ``Host`` values (``name:port``) this server answers to; empty for a wildcard bind (any name)."""
        if self.host in WILDCARD_HOSTS:
            return set()
        bound = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        names = {bound.lower(), *LOOPBACK_HOSTS} if is_loopback(self.host) else {bound.lower()}
        return {f"{name}:{self.port}" for name in names} | ({*names} if self.port == 80 else set())

    def check_host(self, host_header: str | None) -> None:
        """421 unless ``Host`` names this server (a DNS-rebound page sends its own name)."""
        own = self.own_hosts()
        if own and (host_header or "").strip().lower() not in own:
            raise Refused(421, f"Host {(host_header or '')[:100]!r} is not this server; open it as "
                          f"http://{sorted(own)[0]}/")

    def check_token(self, header: str | None, query: str | None, cookie: str | None = None) -> None:
        if self.token is None:
            return
        given = bearer(header) or (query or "") or (cookie or "")
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Refused(401, "this server needs its token: send Authorization: Bearer TOKEN (printed by "
                          "autotune ui with its URL)")

    def has_bearer_token(self, header: str | None) -> bool:
        given = bearer(header)
        return bool(self.token and given and hmac.compare_digest(given.encode(), self.token.encode()))

    def check_origin(self, origin: str | None, fetch_site: str | None, authorization: str | None,
                     host_header: str | None) -> None:
        """A state change must come from this app's own page (its Origin, else Sec-Fetch-Site), or carry the
        token in a header no cross-site page can add."""
        if origin is not None:
            where = origin.strip().lower().removeprefix("http://")
            own = self.own_hosts() or {(host_header or "").strip().lower()}
            if origin.strip().lower().startswith("http://") and where in own:
                return
            raise Refused(403, f"cross-origin request from {origin} refused; use the app's own page")
        if (fetch_site or "").strip().lower() in SAFE_FETCH_SITES or self.has_bearer_token(authorization):
            return
        raise Refused(403, "a request that changes something must come from the app's own page: send Origin: "
                      f"http://{self.host if self.host not in WILDCARD_HOSTS else 'HOST'}:{self.port}")

    def resolve(self, path: str, what: str) -> Path:
        """``path`` made absolute with symlinks followed, or 403 when it lies outside every allowed root."""
        if not path or "\x00" in path:
            raise Refused(403, f"{what}: give a path")
        try:
            resolved = Path(os.path.expanduser(path)).resolve(strict=False)
        except (OSError, RuntimeError):  # a symlink loop, a name too long
            raise Refused(403, f"{what} {path[:200]}: cannot be resolved to a file or folder") from None
        if not any(resolved == root or root in resolved.parents for root in self.allowed_roots):
            roots = ", ".join(str(root) for root in self.allowed_roots)
            raise Refused(403, f"{what} {path}: outside the folders this server may use ({roots}); start autotune "
                          "ui with --allow-dir for another")
        return resolved
