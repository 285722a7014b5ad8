"""`lmsp tail`: a task's text as it arrives and a live status line, across dropped connections."""

import json
import sys
import time

import click

from lmsp import client as lc
from lmsp.console import STATE_STYLE, cli, client_command, clock, rich_console, say


@client_command(cli, "tail")
@click.argument("task_id")
def tail(http: lc.Client, task_id: str, as_json: bool) -> None:
    """Follow a task until it ends: its text and a live status line. Survives dropped connections and api
    restarts; exits 0 when the task succeeded, 1 otherwise. Ctrl-C stops tailing, not the task."""
    sys.exit(tail_task(http, task_id, as_json))


class TailView:
    """What ``lmsp tail`` shows under the text: the current partial line and a status line."""

    def __init__(self, task: dict):
        self.task_id = task["id"]
        self.state = task["status"]
        self.created = task["created_at"]
        self.started: float | None = None     # when the first text of this attempt arrived
        self.chars = 0
        self.tokens: int | None = None        # exact, once the final event gives usage
        self.partial = ""
        self.note = ""
        self.ended: float | None = None

    def add(self, text: str) -> list[str]:
        """Take a delta; return the lines it completed."""
        if self.started is None:
            self.started = time.time()
        self.chars += len(text)
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        return lines

    def restart(self) -> None:
        self.started, self.chars, self.partial = None, 0, ""

    def status(self) -> str:
        now = self.ended or time.time()
        tokens = self.tokens if self.tokens is not None else round(self.chars / 4)
        approx = "" if self.tokens is not None else "~"
        rate = tokens / (now - self.started) if self.started and now > self.started else 0.0
        parts = [self.state, f"{approx}{tokens} tokens", f"{rate:.1f} tok/s", clock(now - self.created),
                 self.task_id]
        return " · ".join(parts) + (f" · {self.note}" if self.note else "")

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text
        line = Text(self.status(), style=f"bold {STATE_STYLE.get(self.state, '')}")
        return Group(Text(self.partial), line) if self.partial else line


FINAL_STATE = {"response.completed": "succeeded", "response.incomplete": "succeeded",
               "response.failed": "failed", "response.cancelled": "cancelled"}


def tail_task(http: lc.Client, task_id: str, as_json: bool) -> int:
    task = http.get_task(task_id)
    if as_json:
        return _tail_json(http, task)
    replay = task["status"] in lc.TERMINAL_STATES  # the events come from the log, not as generated
    console = rich_console()
    view = TailView(task)
    live = None
    if console.is_terminal:
        from rich.live import Live
        live = Live(view, console=console, refresh_per_second=4, transient=True)
        live.start()
    try:
        final = _follow(http, task_id, view, live)
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        if view.partial:
            click.echo(view.partial)
        say(f"stopped following; the task keeps running (`lmsp tasks cancel {task_id}` cancels it)")
        return 130
    except lc.Gone:
        task = http.get_task(task_id)  # events past their retention: the task still has the result
        if live is not None:
            live.stop()
        click.echo(lc.output_text(task.get("response")))
        say(f"{task['status']} (its events are past retention; this is the stored result)")
        return 0 if task["status"] == "succeeded" else 1
    finally:
        if live is not None and live.is_started:
            view.ended = time.time()
            live.stop()
    if view.partial:
        click.echo(view.partial)
    elif live is None and view.chars:
        click.echo()
    return _conclude(http.get_task(task_id), view, final, replay, console)


def _follow(http: lc.Client, task_id: str, view: TailView, live):
    """The task's events into ``view`` (text above the status line, or plain when not a terminal) until it
    ends; its final event, if one came."""
    def out(text: str) -> None:
        if live is not None:
            live.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def dropped(why: str, delay: float) -> None:
        view.note = f"reconnecting in {delay:.0f}s: {why}"

    final = None
    for event in http.follow(task_id, on_disconnect=dropped):
        view.note = ""
        if event.name == lc.TEXT_DELTA:
            for line in view.add(event.data["delta"]):
                out(line)
            if live is None and view.partial:
                sys.stdout.write(view.partial)
                sys.stdout.flush()
                view.partial = ""
        elif event.name == lc.ATTEMPT_STARTED:
            if view.partial:
                out(view.partial)
            view.restart()
            out(f"↻ attempt {event.data.get('attempt', '?')} started: the text above is discarded")
        elif event.name == "response.output_item.added" and view.state in ("queued", "loading"):
            view.state = "running"
        elif event.final:
            final = event
    return final


def _conclude(task: dict, view: TailView, final, replay: bool, console) -> int:
    """The last status line, from the task as it ended; the exit code."""
    view.state = task["status"] if task["status"] in lc.TERMINAL_STATES else FINAL_STATE[final.name]
    # completed and incomplete carry usage themselves; cancelled and failed only in their response object
    usage = (final.data.get("usage") or (final.data.get("response") or {}).get("usage") or {}) if final else {}
    view.tokens = usage.get("output_tokens")
    view.ended = time.time()
    if replay:
        view.started, view.ended = task["created_at"], task["updated_at"]
    view.note = ""
    if view.state == "failed" and task.get("error"):
        view.note = f"{task['error'].get('code')}: {task['error'].get('detail')}"
    if console.is_terminal:
        console.print(view.status(), style=f"bold {STATE_STYLE.get(view.state, '')}")
    else:
        say(view.status())
    return 0 if view.state == "succeeded" else 1


def _tail_json(http: lc.Client, task: dict) -> int:
    """One JSON object per event, then the final task: for scripts."""
    try:
        for event in http.follow(task["id"]):
            click.echo(json.dumps({"id": event.id, "event": event.name, "data": event.data}, ensure_ascii=False))
    except KeyboardInterrupt:
        return 130
    task = http.get_task(task["id"])
    click.echo(json.dumps({"event": "task", "data": task}, ensure_ascii=False))
    return 0 if task["status"] == "succeeded" else 1
