"""What the chaos run puts around its own servers (tests/servers.py): a TCP proxy in front of both
(tests/proxy.py, shared with the follower tests), and a small filesystem for the event log's tablespace."""

import shutil
import subprocess
import time
from pathlib import Path

from tests.servers import PgCluster


class EventDisk:
    """A small tmpfs holding the event log's tablespace, so the run can fill that disk (and only that
    one: the WAL and every other table stay on the cluster's own). Needs mount (root in a container with
    CAP_SYS_ADMIN); ``arrange`` says why not when it cannot."""

    def __init__(self, root: Path, size_mib: int = 256):
        self.mount = root / "eventdisk"
        self.size_mib = size_mib
        self.mounted = False
        self.filler = self.mount / "filler"

    def arrange(self, pg: PgCluster, db: str) -> str | None:
        self.mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m", "tmpfs", str(self.mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return f"cannot mount a tmpfs for the tablespace: {done.stderr.strip()}"
        self.mounted = True
        space = self.mount / "ts"
        space.mkdir()
        shutil.chown(space, "postgres")
        with pg.connect(db) as conn:
            conn.execute(f"CREATE TABLESPACE chaos_events LOCATION '{space}'")
            # The events table, its partitions if it has some, their indexes and TOAST tables.
            rels = conn.execute(
                "SELECT c.oid::regclass::text, c.relkind FROM pg_class c WHERE c.oid IN ("
                " SELECT 'events'::regclass UNION SELECT inhrelid FROM pg_inherits"
                " WHERE inhparent = 'events'::regclass)").fetchall()
            for rel, kind in rels:
                conn.execute(f"ALTER TABLE {rel} SET TABLESPACE chaos_events")
                for (index,) in conn.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = "
                                             f"'{rel}'::regclass").fetchall():
                    if kind != "p":
                        conn.execute(f"ALTER INDEX {index} SET TABLESPACE chaos_events")
        return None

    def fill(self) -> None:
        # dd stops at ENOSPC: the tablespace has no page left to extend a table or an index by.
        subprocess.run(["dd", "if=/dev/zero", f"of={self.filler}", "bs=1M"], capture_output=True)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            self.free()
            for _ in range(20):  # the cluster must be down first (it holds files there)
                if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                    self.mounted = False
                    return
                time.sleep(0.5)
