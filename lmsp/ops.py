"""Operators' commands: the KEDA role (run by the migrate Job) and `lmsp doctor`."""

import math

import click

from common.settings import get_settings
from lmsp.console import cli, fail, say


@cli.command("keda-role")
@click.option("--url", "keda_url", envvar="KEDA_POSTGRES_URL", required=True,
              help="KEDA's login, postgresql://ROLE:PASSWORD@HOST/DB (default KEDA_POSTGRES_URL: the "
                   "Secret lmsp-keda-postgres's `connection`).")
def keda_role(keda_url: str) -> None:
    """Create or update KEDA's read-only role (it counts tasks per model), after `lmsp migrate`."""
    import psycopg

    from common import keda
    from common.db import ensure_migrated, make_engine, shown_url
    url = get_settings().db_url
    engine = make_engine(url)
    try:
        ensure_migrated(engine)   # the grants need the tables
    finally:
        engine.dispose()
    try:
        role = keda.grant(url, keda_url)
    except ValueError as exc:
        fail(f"{exc}; fix `connection` in k8s/keda-secret.env and recreate Secret lmsp-keda-postgres")
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0]
        fail(f"KEDA's role on {shown_url(url)} failed: {reason}; LMSP_DATABASE_URL's user must own the "
             f"database and may create roles (CREATEROLE), and KEDA's URL ({shown_url(keda_url)}) must "
             "reach the same database")
    say(f"KEDA's role {role} can count tasks (read-only) in {shown_url(url)}")


def _finite(value: float) -> float:
    if not math.isfinite(value):  # nan passes every range (each comparison is false), inf fails every disk
        raise click.BadParameter(f"{value} is not a number of GiB")
    return value


@cli.command("doctor")
@click.option("--model", "models", multiple=True, help="Check these models only (a worker host's own); "
              "default: every model of the registry.")
@click.option("--min-free-gib", type=click.FloatRange(min=0), default=10.0, show_default=True,
              callback=lambda _ctx, _param, value: _finite(value), help="Free space the model cache needs.")
def doctor(models: tuple[str, ...], min_free_gib: float) -> None:
    """Check this host: Postgres and Redis by the configured URLs, the schema, the clock against the
    database, the models (and their revision), the GPU as torch sees it, free disk, this host's worker
    ids. One line each, and what to do when it fails; exits 1 if any fails."""
    from lmsp.doctor import Doctor, run
    ids = tuple(m for arg in models for m in arg.split(",") if m)
    failed = run(Doctor(get_settings(), ids, min_free_gib), click.echo)
    if failed:
        fail(f"{failed} check{'s' if failed > 1 else ''} failed: each FAIL line says what to do")
    say("every check passed")
