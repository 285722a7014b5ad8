"""`lmsp doctor`: what an operator checks on any host, one line each, with what to do when it fails.

Each check returns (ok, what it found or what to do). They run in order and never stop at a failure:
a host with no database still reports its models, GPU and disk. The database checks use one connection
(a timeout of a few seconds), and nothing here writes anywhere."""

import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from common.settings import Settings

Check = tuple[str, Callable[[], tuple[bool, str]]]
SKEW_SECONDS = 2.0        # of a 30 s lease: more and a healthy worker's lease looks older or younger


def _first_line(exc: BaseException) -> str:
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]


class Doctor:
    def __init__(self, settings: Settings, models: tuple[str, ...] = (), min_free_gib: float = 10.0):
        self.settings, self.models, self.min_free_gib = settings, models, min_free_gib
        self.engine = None
        self.migrated = False

    def checks(self) -> list[Check]:
        return [("database", self.database), ("schema", self.schema), ("clock", self.clock),
                ("broker", self.broker), ("redis", self.redis), *self.model_checks(),
                ("gpu", self.gpu), ("disk", self.disk), ("worker ids", self.worker_ids)]

    # -- the database ----------------------------------------------------------------------------------
    def database(self) -> tuple[bool, str]:
        from sqlalchemy import text

        from common.db import make_engine, shown_url
        url = self.settings.db_url
        if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
            return False, (f"no database file {url.removeprefix('sqlite:///')}: `lmsp dev` makes one; beyond one "
                           "host set LMSP_DATABASE_URL to Postgres")
        try:
            connect = {"connect_args": {"connect_timeout": 5}} if url.startswith("postgres") else {}
            self.engine = make_engine(url, **connect)
            with self.engine.connect() as conn:
                version = conn.execute(text("SELECT version()")).scalar() if url.startswith("postgres") \
                    else "SQLite"
        except Exception as exc:  # noqa: BLE001 - any failure is the line's answer
            self.engine = None
            return False, (f"cannot reach {shown_url(url)}: {_first_line(exc)}; check LMSP_DATABASE_URL "
                           "(host, port, user, password, database) and that this host may connect")
        return True, f"{shown_url(url)} ({version.split(' on ')[0]})"

    def schema(self) -> tuple[bool, str]:
        if self.engine is None:
            return False, "not checked: no database (above)"
        from common.db import ensure_migrated
        try:
            ensure_migrated(self.engine)
        except Exception as exc:  # noqa: BLE001
            return False, _first_line(exc)
        self.migrated = True
        return True, "at the latest migration"

    def clock(self) -> tuple[bool, str]:
        if self.engine is None:
            return False, "not checked: no database (above)"
        from sqlalchemy import select

        from common.db import db_now
        with self.engine.connect() as conn:
            before = time.time()
            theirs = conn.execute(select(db_now())).scalar()
            mine = (before + time.time()) / 2
        skew = mine - float(theirs)
        if abs(skew) > SKEW_SECONDS:
            return False, (f"this host's clock is {skew:+.1f} s off the database's (leases are "
                           f"{self.settings.lease_seconds:g} s): sync it (chrony or systemd-timesyncd)")
        return True, f"{skew:+.2f} s against the database"

    def worker_ids(self) -> tuple[bool, str]:
        """The ids registered from this host's name, with their state: two hosts of one name show here."""
        if not self.migrated:
            return False, "not checked: the schema (above)"
        from sqlalchemy import select

        from common.db import db_now
        from common.tables import Worker
        host = socket.gethostname()
        mine = Worker.id.like(f"{host}:%")   # lmsp worker --gpus: host:gpuN
        if self.settings.worker_id:          # a pod: its name (LMSP_WORKER_ID)
            mine = mine | (Worker.id == self.settings.worker_id)
        with self.engine.connect() as conn:
            rows = conn.execute(select(Worker.id, Worker.state, Worker.stopped_at, db_now() - Worker.heartbeat_at)
                                .where(mine).order_by(Worker.id)).all()
        if not rows:
            return True, f"none yet under this host's name {host}"
        shown = [f"{wid} ({'stopped' if stopped else (state or 'ready')}, {age:.0f} s ago)"
                 for wid, state, stopped, age in rows]
        return True, f"{host}: " + ", ".join(shown)

    # -- Redis -----------------------------------------------------------------------------------------
    def broker(self) -> tuple[bool, str]:
        url = self.settings.broker
        if url.startswith("filesystem://"):
            return True, f"filesystem broker under {self.settings.broker_folder} (one host only: lmsp dev)"
        return self._ping(url, "LMSP_BROKER_URL")

    def redis(self) -> tuple[bool, str]:
        if not self.settings.redis_url:
            return True, "none (LMSP_REDIS_URL unset: event streams poll Postgres)"
        return self._ping(self.settings.redis_url, "LMSP_REDIS_URL")

    @staticmethod
    def _ping(url: str, name: str) -> tuple[bool, str]:
        import re

        import redis
        shown = re.sub(r"//[^@/]*@", "//***@", url)
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
            version = client.info("server")["redis_version"]
            client.close()
        except Exception as exc:  # noqa: BLE001
            return False, (f"cannot reach {shown}: {_first_line(exc)}; check {name} (host, port, password) "
                           "and that this host may connect")
        return True, f"{shown} (Redis {version})"

    # -- models, GPU, disk -----------------------------------------------------------------------------
    def model_checks(self) -> list[Check]:
        from common.registry import Registry
        try:
            registry = Registry.load(self.settings.models_path)
        except Exception as exc:  # noqa: BLE001
            message = f"{_first_line(exc)}; fix {self.settings.models_path}"
            return [("models", lambda: (False, message))]
        unknown = [m for m in self.models if m not in registry.models]
        if unknown:
            return [("models", lambda: (False, f"{', '.join(unknown)} not in {self.settings.models_path}; "
                                               "`lmsp models list --registry` shows the ids"))]
        specs = [registry.models[m] for m in self.models] if self.models else list(registry.models.values())
        return [(f"model {spec.id}", lambda spec=spec: self._model(spec)) for spec in specs]

    @staticmethod
    def _model(spec) -> tuple[bool, str]:
        from common.registry import CheckpointMissing, local_checkpoint, source_of
        source = source_of(spec)
        try:
            folder = local_checkpoint(spec)
        except CheckpointMissing as exc:
            return False, str(exc)
        if source.kind == "folder":
            return True, source.describe()
        revision = f" at commit {Path(folder).name}" if source.kind == "hub" else ""
        return True, f"{source.describe()}{revision}: {folder}"

    def gpu(self) -> tuple[bool, str]:
        import importlib.metadata as meta
        try:
            meta.version("vllm")
            gpu_build = True
        except meta.PackageNotFoundError:
            gpu_build = False
        import torch
        if not torch.cuda.is_available():
            if gpu_build:
                return False, (f"torch {torch.__version__} sees no GPU: install an NVIDIA driver that supports "
                               "CUDA 13 (and, in a container, the NVIDIA container toolkit and --gpus)")
            return True, f"none: the CPU build (torch {torch.__version__})"
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return True, f"{len(names)} ({', '.join(names)}), CUDA {torch.version.cuda}, torch {torch.__version__}"

    def disk(self) -> tuple[bool, str]:
        """Free space where models are written: the hub's cache (a repo id's files) and LMSP_HOME's
        (imported GGUFs, the default model), the fuller of the two when they are apart."""
        from huggingface_hub import constants

        def existing(path: Path) -> Path:
            while not path.exists():
                path = path.parent
            return path
        places = {existing(Path(constants.HF_HUB_CACHE)), existing(self.settings.model_cache)}
        free, where = min((shutil.disk_usage(place).free / 2 ** 30, place) for place in places)
        if free < self.min_free_gib:
            return False, (f"{free:.1f} GiB free under {where} (a model cache; below {self.min_free_gib:g}): "
                           "free space or move HF_HOME / LMSP_HOME to a bigger volume")
        return True, f"{free:.0f} GiB free under {where}"


def run(doctor: Doctor, echo: Callable[[str], None]) -> int:
    """Every check, one line each; the number that failed."""
    failed = 0
    for name, check in doctor.checks():
        try:
            ok, message = check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed line, not a traceback
            ok, message = False, f"the check itself failed: {_first_line(exc)}"
        failed += not ok
        echo(f"{'ok  ' if ok else 'FAIL'}  {name}: {message}")
    return failed
