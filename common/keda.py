"""KEDA's database role: it reads how many tasks each model has queued and running, and nothing else.

The migrate Job creates it (or brings it up to date) right after the migration, from the very login KEDA
is given (Secret lmsp-keda-postgres), so the two cannot disagree and the grants find the tables. Every
step stops on the first error, and the role's own query is tried last: a first install that cannot
autoscale fails its Job instead of leaving KEDA with "permission denied"."""

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

# What KEDA's ScaledObjects read (k8s/models/*/kustomization.yaml): tasks' model and status.
COLUMNS = ("model", "status")


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://) as libpq takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def login_of(keda_url: str) -> tuple[str, str]:
    try:
        info = conninfo_to_dict(keda_url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"KEDA's connection is not a postgresql:// URL ({exc})") from None
    if not info.get("user") or not info.get("password"):
        raise ValueError("KEDA's connection URL needs a user and a password (postgresql://lmsp_keda:...@host/db)")
    return info["user"], info["password"]


def grant(owner_url: str, keda_url: str) -> str:
    """Create or update the role of ``keda_url`` as the database's owner, then count as it. Idempotent: a
    second run sets the same password and grants again. Returns the role's name."""
    role, password = login_of(keda_url)
    name = sql.Identifier(role)
    with psycopg.connect(libpq_url(owner_url), autocommit=True) as conn, conn.transaction():
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
        verb = sql.SQL("ALTER" if exists else "CREATE")
        conn.execute(sql.SQL("{} ROLE {} LOGIN PASSWORD {}").format(verb, name, sql.Literal(password)))
        database = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), name))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(name))
        conn.execute(sql.SQL("GRANT SELECT ({}) ON tasks TO {}").format(
            sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), name))
        conn.execute(sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(name))
    with psycopg.connect(keda_url, connect_timeout=10) as conn:   # what KEDA will do, with its own login
        conn.execute("SELECT count(*) FROM tasks WHERE model = '' AND status = 'queued'")
    return role
