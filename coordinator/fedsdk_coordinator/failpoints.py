"""Crash points for restart tests: the coordinator kills itself (SIGKILL, as ``kill -9`` would) at a named
stage of a named round.

``FEDSDK_FAILPOINT=ROUND:STAGE`` in the coordinator's environment arms one point; nothing is armed
otherwise, and an unarmed point costs one comparison. The stages, in the order a round passes them:

=====================  =================================================================================
``tasks_sent``         the round's plan is stored and its tasks are published
``reply_stored``       the round's first reply is committed
``all_stored``         the reply that completes the round is committed (aggregation has not started)
``aggregate_stored``   the aggregate is committed, not yet published
``aggregate_published``  the aggregate is published (devices apply it; their reports may be on the way)
``report_stored``      the round's first device report is taken
``round_completed``    the round's completion is committed (the next round is not planned yet)
=====================  =================================================================================

A crash is a ``kill -9`` at a precise moment, so a test can restart the coordinator at each stage and
compare with an uninterrupted run (``tests/integration/test_restart_points.py``).
"""

from __future__ import annotations

import os
import signal

__all__ = ["STAGES", "reached"]

STAGES = (
    "tasks_sent",
    "reply_stored",
    "all_stored",
    "aggregate_stored",
    "aggregate_published",
    "report_stored",
    "round_completed",
)

_ARMED = os.environ.get("FEDSDK_FAILPOINT", "")


def reached(stage: str, round_id: int) -> None:
    """Kill this process now if ``round_id:stage`` is the armed point."""
    if _ARMED and _ARMED == f"{round_id}:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)
