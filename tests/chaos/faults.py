"""The seeded fault schedule: which fault, on what, when, for how long. Pure, so a seed names one run."""

import random

# kind -> (targets, (shortest, longest) hold in seconds; None: a lease-relative pause)
KINDS: dict[str, tuple[tuple[str, ...], tuple[float, float] | None]] = {
    "worker_kill": (("a", "b"), (1, 8)),         # kill -9 of the worker alone; it is started again after
    "worker_stop": (("a", "b"), None),           # SIGSTOP past the lease, then SIGCONT
    "engine_kill": (("a", "b"), (0, 0)),         # kill -9 of its EngineCore
    "redis_restart": (("redis",), (1, 8)),       # down, back empty
    "redis_flush": (("redis",), (0, 0)),         # FLUSHALL while up
    "postgres_restart": (("fast", "immediate"), (1, 8)),  # stop (clean or a crash), start again
    "api_kill": (("api",), (1, 4)),              # kill -9 of gunicorn, master and workers; started again
    "proxy_cut": (("postgres", "redis"), (2, 15)),    # every connection reset, new ones refused
    "proxy_stall": (("postgres", "redis"), (2, 15)),  # bytes held, connections open
    "disk_full": (("events",), (5, 20)),         # the event log's tablespace has no free page
    "maintenance_kill": (("a", "b"), (1, 8)),    # kill -9 of a worker in partition maintenance; started again
    "grammar_kill": (("api",), (0, 0)),          # kill -9 of the api's grammar helpers and their spawner
}


def schedule(seed: int, seconds: float, lease: float, kinds: list[str] | None = None,
             warmup: float = 20, gap: tuple[float, float] = (10, 30), tail: float = 20) -> list[dict]:
    """Faults one after another from ``warmup`` until ``tail`` seconds before the end, each followed by a gap."""
    rng = random.Random(seed)
    kinds = kinds or list(KINDS)
    out, t = [], warmup
    while True:
        kind = rng.choice(kinds)
        targets, span = KINDS[kind]
        hold = rng.uniform(lease + 2, 2 * lease + 2) if span is None else rng.uniform(*span)
        if t + hold > seconds - tail:
            return out
        out.append({"at": round(t, 1), "kind": kind, "target": rng.choice(targets), "hold": round(hold, 1)})
        t += hold + rng.uniform(*gap)
