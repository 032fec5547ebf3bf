"""`inference-gateway probe`: ask a running gateway's /healthz or /readyz where its config serves them.

A container's HEALTHCHECK cannot know whether the config moved the operator routes to
`admin_listen`; this reads the config and asks the listener that serves them, so that one image
command is right for every config.
"""

from __future__ import annotations

import ipaddress
import urllib.error
import urllib.request

from gateway.settings import Settings

WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


class CannotProbe(Exception):
    """The config does not say where to ask (a port of 0 is chosen at start and known only then)."""


def probe_url(settings: Settings, path: str) -> str:
    listener = settings.admin_listen or settings.listen
    if listener.port == 0:
        which = "admin_listen" if settings.admin_listen else "listen"
        raise CannotProbe(f"{which}.port is 0: the port is chosen at start; give --port")
    return f"http://{_reachable_host(listener.host)}:{listener.port}{path}"


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """Whether `url` answered 2xx within the timeout, and one line saying what it answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return True, f"{url}: {answer.status}"
    except urllib.error.HTTPError as error:
        return False, f"{url}: {error.code} {error.read(200).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return False, f"{url}: {reason}"


def _reachable_host(host: str) -> str:
    # A wildcard bind listens on loopback too; ask there, never across the network.
    if host in WILDCARD_HOSTS:
        return "[::1]" if host == "::" else "127.0.0.1"
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        return host
    return f"[{host}]" if is_v6 else host
