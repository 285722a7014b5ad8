from alembic import context
from sqlalchemy import pool

from common.db import make_engine
from common.partitions import is_partition
from common.tables import Base

config = context.config
MIGRATION_LOCK = 0x6C6D7370_6D696772  # "lmspmigr": one advisory lock for every lmsp migration


def include_name(name, kind, _parent) -> bool:
    """The event log's partitions are made and dropped at run time (common/partitions.py), not here."""
    return not (kind == "table" and is_partition(name))


def run() -> None:
    url = config.get_main_option("sqlalchemy.url")
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            # Two migrations at once (a manual `lmsp migrate` beside compose's migrate service or the Job):
            # both found no alembic_version and one failed creating it. The second now waits, then finds
            # nothing to do.
            connection.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK})")
            connection.commit()  # the lock is the session's: held until this connection closes
        context.configure(connection=connection, target_metadata=Base.metadata, include_name=include_name,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run()
