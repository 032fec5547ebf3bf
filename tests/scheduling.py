"""The order the suite's two workers take its files in (`--dist loadfile`): the files holding floods
(tests marked `flood`, which run while no other test of real servers does: tests/conftest.py) go to
one worker first, as one unit, while the other works through the files of tests in one process,
which may run beside a flood; the rest follow, largest first as xdist orders them. Taken in xdist's
plain order, the floods came late, each behind the other worker's tests of real servers, and that
worker idled through them."""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadFileScheduling

FLOOD_FILES = frozenset(
    {
        "tests/adversarial/test_redis_cluster.py",
        "tests/integration/test_auto_concurrency.py",
        "tests/integration/test_decoupled_overload.py",
        "tests/integration/test_grpc_overload.py",
        "tests/integration/test_overload_shares.py",
        "tests/integration/test_request_kinds_overload.py",
        "tests/integration/test_sequences.py",
    }
)
"""Every file with a test marked `flood` (checked at collection: tests/conftest.py)."""
FLOODS = "floods"
SLOW_ROOMS = frozenset({"integration", "adversarial", "deploy"})
"""Test folders whose tests start real servers: the fast tier (`-m "not slow"`) leaves them out,
and the tests of the others, in one process, may run beside a flood."""


def rank(scope: str) -> int:
    """Floods first, then the files of tests in one process, then those of real servers."""
    if scope == FLOODS:
        return 0
    return 2 if scope.split("/")[1] in SLOW_ROOMS else 1


class FloodsFirst(LoadFileScheduling):
    """xdist's file-by-file scheduling, the floods' files one unit taken first, then the fast rooms'."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        return FLOODS if scope in FLOOD_FILES else scope

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:  # the queue is made, by size, just before the first unit is handed out
            self._ordered = True
            self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda unit: rank(unit[0])))
        super()._assign_work_unit(node)
