"""The ``lmsp`` command: admin (serve, worker, dev, migrate, models, tokens) and client commands
(ask, submit, tail, tasks, models list) in one click group. Each kind lives in a module of its own;
importing them here registers their commands on the group (``lmsp.console.cli``).
"""

from common.settings import ConfigError
from lmsp import admin, commands, ops, servers, tail  # noqa: F401 (registers the commands)
from lmsp.console import cli, fail


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="lmsp")
    except ConfigError as exc:  # the environment, the models file or the database: one line, no traceback
        fail(str(exc))


if __name__ == "__main__":
    main()
