"""What every part of the ``lmsp`` command shares: the click group and its sub-groups, messages,
the database of admin commands, the client commands' options and error hints, and how results look.

Results go to stdout, progress and messages to stderr. Admin commands import the server side
lazily, so client commands start fast.
"""

import json
import sys
import time
from functools import wraps

import click

from common.settings import get_settings
from lmsp import client as lc

DEFAULT_MODEL = "smollm2:135m"
SAMPLE_PROMPT = "Say hello in one sentence."


def say(message: str) -> None:
    click.echo(f"lmsp: {message}", err=True)


def fail(message: str, code: int = 1):
    say(message)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """LMSP 1.0 task service: run it (dev, serve, worker) and use it (ask, submit, tail, tasks)."""


@cli.group()
def tokens() -> None:
    """API tokens."""


@cli.group()
def models() -> None:
    """Models: the served ones, the local registry, importing GGUF files."""


@cli.group()
def tasks() -> None:
    """Your tasks: list, show, cancel."""


def sessions():
    from common.db import ensure_migrated, make_engine, session_factory
    engine = make_engine(get_settings().db_url)
    ensure_migrated(engine)
    return session_factory(engine)


# client commands =======================================================================================
HINTS = {
    "unauthorized": "Pass --token or set LMSP_TOKEN; `make run` writes a dev token to {token_path}, "
                    "`lmsp tokens create --principal NAME` makes others.",
    "insufficient_scope": "Use a token with that scope (`lmsp tokens create --principal NAME --scopes ...`).",
    "model_not_found": "`lmsp models list` shows the models this service serves.",
    "model_unavailable": "No worker serves the model yet: wait for `make run` to say it is ready, or start "
                         "`lmsp worker --model ID`; `lmsp submit` queues a task that waits for one.",
    "task_not_found": "`lmsp tasks list` shows your tasks.",
    "context_length_exceeded": "Shorten the prompt, or pick a model with a larger context window "
                               "(`lmsp models list`).",
    "rate_limited": "Wait a moment and retry.",
    "overloaded": "The queue is full: retry later.",
    "task_not_cancelable": "It has already finished: `lmsp tasks show ID` shows the result.",
}


def with_client(fn):
    """Run ``fn(client, **kwargs)`` with a client for ``url``/``token``; its errors become messages that
    say what to do next."""

    @wraps(fn)
    def run(url=None, token=None, **kwargs):
        token = token or lc.default_token()
        if not token:
            fail(f"no token: pass --token, set LMSP_TOKEN, or start the service with `make run` "
                 f"(it writes {lc.dev_token_path()})")
        try:
            # Few retries: a person waits for an answer (tail reconnects on its own for longer).
            with lc.Client(url, token, max_retries=3) as http:
                try:
                    return fn(http, **kwargs)
                except KeyError as exc:  # a JSON object without a member LMSP's always have
                    raise lc.UnexpectedAnswer(f"{http.url} answered without {exc}: is that the LMSP service?") \
                        from None
        except lc.ProblemError as exc:
            hint = HINTS.get(exc.code, "").format(token_path=lc.dev_token_path())
            where = f" [{exc.param}]" if exc.param else ""
            fail(f"{exc.detail} ({exc.status} {exc.code}){where}" + (f"\n  {hint}" if hint else ""))
        except lc.ServiceUnreachable as exc:
            fail(f"{exc}\n  Is the service running? `make run` starts it; --url or LMSP_URL points elsewhere.")
        except lc.UnexpectedAnswer as exc:
            fail(f"{exc} (--url or LMSP_URL sets its address)")
        except lc.ClientError as exc:
            fail(str(exc))

    return run


def connection_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")(fn)
    fn = click.option("--token", envvar="LMSP_TOKEN",
                      help="API token (default LMSP_TOKEN, then the dev token of `make run`).")(fn)
    return click.option("--url", envvar="LMSP_URL",
                        help="Service URL (default LMSP_URL, else where `lmsp dev` serves).")(fn)


def client_command(group, name: str):
    """A client command: --url/--token/--json options and a ``lc.Client`` as first argument."""
    return lambda fn: group.command(name)(connection_options(with_client(fn)))


def print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def rich_console():
    from rich.console import Console
    return Console(highlight=False)


def ago(unix: float) -> str:
    seconds = max(0, int(time.time() - unix))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def duration(task: dict) -> str:
    end = task["updated_at"] if task["status"] in lc.TERMINAL_STATES else time.time()
    return clock(end - task["created_at"])


def output_tokens(task: dict) -> str:
    usage = (task.get("response") or {}).get("usage")
    return str(usage["output_tokens"]) if usage else "-"


STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "cancelling": "yellow",
               "running": "cyan", "loading": "cyan", "queued": "blue", "ready": "green", "unavailable": "red"}


def styled(state: str):
    from rich.text import Text
    return Text(state, style=STATE_STYLE.get(state, ""))

