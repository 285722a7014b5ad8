"""The chaos run on a Postgres pair (LMSP_CHAOS_PAIR=1, or postgres_failover among LMSP_CHAOS_FAULTS): a
primary and a streaming standby under synchronous replication (tests/faults/test_failover.py builds them
the same way), each behind its own link of the run's proxy, and the service on a multi-host URL with
target_session_attrs=read-write (README, "Postgres for zero loss").

Its fault, ``postgres_failover``: the primary crashes (every process of it SIGKILLed), the standby is
promoted, then a new standby is made from it (pg_basebackup) behind the dead server's link and
replication is synchronous again, so the next failover loses nothing either. Drawn in its own schedule:
the pair's second server, the synchronous commits and a base backup per failover cost more than two
cores carry beside the default run, and disk_full (the log's tablespace on a small tmpfs) does not mix
with a standby that replays onto it, so that fault is left out."""

import time
from pathlib import Path

from tests.faults.test_failover import Standby, _crash, _is_primary
from tests.harness import wait_for
from tests.servers import PgCluster


class Pair:
    def __init__(self, root: Path, primary: PgCluster):
        self.root, self.primary, self.made = root, primary, 0
        self.standby = self._new_standby()

    def _new_standby(self) -> Standby:
        self.made += 1
        standby = Standby(self.root / f"standby-{self.made}", self.primary)
        with self.primary.connect() as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
            conn.execute("SELECT pg_reload_conf()")
            wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")
                     .fetchone()[0] == 1, 120, "no synchronous standby")
        return standby

    def url(self, db: str, ports: tuple[int, int] | None = None) -> str:
        a, b = ports or (self.primary.port, self.standby.port)
        return f"postgresql://postgres@127.0.0.1:{a},127.0.0.1:{b}/{db}?target_session_attrs=read-write"

    def fail_over(self) -> tuple[int, int, float]:
        """Crash the primary, promote the standby, make a new standby of it. Returns the dead server's
        port, the new standby's, and how long the service had no primary."""
        dead = self.primary
        began = time.monotonic()
        _crash(dead)
        self.standby.ctl("promote")
        wait_for(lambda: _is_primary(self.standby), 60, "the standby was not promoted")
        down = time.monotonic() - began
        self.primary = self.standby
        dead.close()
        self.standby = self._new_standby()
        return dead.port, self.standby.port, down

    def close(self) -> None:
        for cluster in (self.standby, self.primary):
            cluster.close()
