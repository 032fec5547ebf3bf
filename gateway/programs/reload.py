"""Config reload without a restart: SIGHUP, a watch of the config file, and `POST /admin/config/reload`.

Each reads the file, validates it, plans the change (gateway.settings.reload) and applies the live
part at once, in one turn of the event loop: requests in flight keep what they were admitted
under, a stream open across the reload ends whole. A config that fails to load or validate leaves
the last good one serving; either way the attempt is logged and counted
(`gateway_config_reloads_total{result}`), and `gateway_config_info{hash}` names the config that
runs. The file is watched by its path, checked every second: an edit, or a Kubernetes ConfigMap
that swaps the symlink the path goes through, is a new file to read.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.flow.controller import AdmissionController
from gateway.flow.request_meta import RequestClassifier
from gateway.flow.status import StatusBoard
from gateway.flow.windows import WindowClock
from gateway.queues.base import RequestQueue
from gateway.settings import ConfigError, Settings, load_settings
from gateway.settings.reload import plan_reload
from gateway.telemetry.access_log import AccessLog

log = logging.getLogger("gateway.reload")

WATCH_INTERVAL_S = 1.0


class ConfigReloader:
    def __init__(
        self,
        path: str,
        settings: Settings,
        *,
        classifier: RequestClassifier,
        windows: WindowClock,
        controller: AdmissionController,
        board: StatusBoard,
        store: RequestQueue,
        registry: CollectorRegistry,
        access: AccessLog | None = None,
    ) -> None:
        self.path = path
        self.settings = settings
        """The settings that run (as applied: the restart-only changes left out)."""
        self._classifier = classifier
        self._windows = windows
        self._controller = controller
        self._board = board
        self._store = store
        self._access = access
        self._reloads = Counter(
            "gateway_config_reloads", "Config reloads, by result.", ["result"], registry=registry
        )
        self._info = Gauge(
            "gateway_config_info", "The config that runs, by its hash.", ["hash"], registry=registry
        )
        for result in ("ok", "error"):
            self._reloads.labels(result)
        self._file = _loaded(path) or settings
        """The config as the file said it at the start (the running settings differ by the command
        line's overrides and the ports bound for 0): what a restart-only change is told against."""
        self._hash = settings.config_hash()
        self._info.labels(self._hash).set(1)
        self._seen = _file_state(path)

    def reload(self, trigger: str) -> dict[str, Any]:
        """Read, validate and apply the file now; what happened (the admin route's answer)."""
        try:
            plan = plan_reload(self._file, load_settings(self.path), self.settings)
        except ConfigError as error:  # its messages name fields, never a key
            self._reloads.labels("error").inc()
            problems = error.problems
            log.error(
                "config reload (%s) failed, the last good config goes on: %s", trigger, "; ".join(problems)
            )
            return {"result": "error", "problems": problems, "hash": self._hash}
        self._classifier.reload(plan.applied)
        self._windows.reload_weights(plan.applied)
        self._controller.reload_waits(plan.applied.priorities)
        self.settings = plan.applied
        self._info.remove(self._hash)
        self._hash = self._board.config_hash = plan.applied.config_hash()
        self._store.identify(self._hash)  # the others' status pages show it from its next beat
        if self._access is not None:
            lines = plan.applied.access_log
            self._access.reconfigure(lines.enabled, lines.format, lines.max_lines_per_s)
        self._info.labels(self._hash).set(1)
        self._reloads.labels("ok").inc()
        log.warning(
            "config reloaded (%s): applied %s; restart-only, not applied: %s",
            trigger,
            "; ".join(plan.live) or "nothing",
            "; ".join(plan.restart_only) or "nothing",
        )
        return {"result": "ok", "applied": plan.live, "restart_only": plan.restart_only, "hash": self._hash}

    async def watch(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reload whenever the file at the path changes (a supervised loop)."""
        task_status.started()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            state = _file_state(self.path)
            if state != self._seen:
                self._seen = state
                if state is not None:
                    self.reload("file changed")


def _loaded(path: str) -> Settings | None:
    try:
        return load_settings(path)
    except ConfigError:
        return None


def _file_state(path: str) -> tuple[int, int, float, int] | None:
    """What tells one file at `path` from another, through symlinks: device, inode, mtime, size."""
    try:
        found = os.stat(Path(path))
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime, found.st_size
