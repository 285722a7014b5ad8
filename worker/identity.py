"""One live process per worker id.

A worker's id is what recovery goes by: at boot a worker hands on whatever its id ran and ends the
engines its id left behind. A second process started with the id of a live worker (two workers on
one GPU, a copied ``LMSP_WORKER_ID``) would do that to the live one, so it refuses to start. (A
worker paused while another process took its id over exits when it wakes: ``heart.beat``.)
"""

import logging
import time

from common import liveness
from common.settings import ConfigError

log = logging.getLogger("lmsp.worker")
# What a worker's Postgres connections call themselves (pg_stat_activity): a refused duplicate names
# the address the live one connects from.
APPLICATION = "lmsp-worker {}"


class DuplicateWorker(ConfigError):
    """Another live process has this worker id. A restart would be refused again: a supervisor does not
    restart a worker that exits with this code (EX_CONFIG)."""
    exit_code = 78


def ensure_sole(sessions, worker_id: str, lease_seconds: float, heartbeat_seconds: float) -> None:
    """Raise ConfigError if another process heartbeats as ``worker_id``. A fresh heartbeat alone
    does not tell a live worker from one killed a moment ago (then restarted with its id, as a
    supervisor does): watch it for two heartbeats."""
    with sessions() as session:
        seen = liveness.lease_of(session, worker_id, lease_seconds)
    if seen is None:
        return  # never ran, stopped cleanly, or dead for a lease
    window = 2 * heartbeat_seconds + 1
    log.info("worker id %s heartbeated %.1f s ago; checking for %.0f s that no other process uses it",
             worker_id, max(seen[1], 0.0), window)
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        time.sleep(min(0.5, heartbeat_seconds / 2))
        with sessions() as session:
            now = liveness.lease_of(session, worker_id, lease_seconds)
        if now is not None and now[0] != seen[0]:
            raise DuplicateWorker(
                f"another worker is running with id {worker_id} (it heartbeated {max(now[1], 0.0):.1f} s "
                f"ago{_held_from(sessions, worker_id)}); give each worker its own LMSP_WORKER_ID (or --gpu), "
                "or stop the other one first. Ids are <hostname>:gpuN: two hosts of one hostname collide, "
                "so give this host its own name (compose's workers take the host's: uts: host)")


def _held_from(sessions, worker_id: str) -> str:
    """Where the live holder of ``worker_id`` connects from, and this process, as Postgres sees them."""
    from sqlalchemy import text
    try:
        with sessions() as session:
            if session.bind.dialect.name != "postgresql":
                return ""
            theirs = session.execute(text(
                "SELECT DISTINCT host(client_addr) FROM pg_stat_activity WHERE application_name = :name "
                "AND pid <> pg_backend_pid() AND client_addr IS NOT NULL"),
                {"name": APPLICATION.format(worker_id)[:63]}).scalars().all()
            mine = session.execute(text("SELECT host(inet_client_addr())")).scalar()
    except Exception:  # noqa: BLE001 - the message is better with it, and right without it
        return ""
    if not theirs:
        return ""
    return f", from {', '.join(theirs)}" + (f"; this process connects from {mine}" if mine else "")
