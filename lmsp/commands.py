"""Client commands: models list, ask, submit, tasks list/show/cancel."""

import json
import re
import sys
from pathlib import Path

import click

from common.settings import get_settings
from lmsp import client as lc
from lmsp.console import (
    ago,
    cli,
    client_command,
    connection_options,
    duration,
    fail,
    models,
    output_tokens,
    print_json,
    rich_console,
    say,
    styled,
    tasks,
    with_client,
)
from lmsp.tail import tail_task


# -- models list ----------------------------------------------------------------------------------
@models.command("list")
@click.option("--registry", is_flag=True, help="The local registry file instead of the service (no token).")
@connection_options
def models_list(registry: bool, url, token, as_json: bool) -> None:
    """The models the service serves, with their state (--registry: the local registry)."""
    if not registry:
        return _served_models(url=url, token=token, as_json=as_json)
    from common.registry import Registry, detect_machine, local_checkpoint, resolve_engine, source_of
    path = get_settings().models_path
    specs = list(Registry.load(path).models.values())
    if as_json:
        return print_json([s.model_dump(mode="json") for s in specs])
    if not specs:  # said on stderr: the list (stdout) stays empty for scripts
        say(f"no model in {path}" + ("" if path.exists() else " (there is no such file: check LMSP_MODELS_FILE)")
            + "; `make model` imports the default, `lmsp models import-gguf` another")
    machine = detect_machine()  # engine settings as a worker on this machine resolves them
    for spec in specs:
        try:
            present = "present " + local_checkpoint(spec)
        except FileNotFoundError:
            present = f"missing (`lmsp models pull {spec.id}`)"
        click.echo(f"{spec.id}\t{source_of(spec).describe()}\t{present}\tcontext={spec.context_window}\t"
                   f"{resolve_engine(spec, machine).summary()}")


@with_client
def _served_models(http: lc.Client, as_json: bool) -> None:
    data = http.models()
    if as_json:
        return print_json(data)
    from rich.table import Table
    table = Table("MODEL", "STATE", "WORKERS", "LOADED ON", "CONTEXT", "MAX OUTPUT", "CAPABILITIES", box=None)
    for m in data:
        caps = ",".join(k for k, v in m["capabilities"].items() if v)
        # A worker of several models serves one it has not loaded (it loads it on demand).
        loaded = (m.get("extensions") or {}).get("x-lmsp-residency", {}).get("loaded_on")
        table.add_row(m["id"], styled(m["status"]), str(m["workers"]),
                      ", ".join(loaded or []) or ("none (loaded on demand)" if m["workers"] else "-"),
                      str(m["context_window"]), str(m["max_output_tokens"]), caps)
    rich_console().print(table)


# -- ask --------------------------------------------------------------------------------------------
@client_command(cli, "ask")
@click.argument("prompt")
@click.option("--model", help="Model id (default: the first ready one).")
@click.option("--json-schema", "schema_file", type=click.File("r"),
              help="Answer as JSON that matches this JSON Schema file.")
@click.option("--max-output-tokens", type=click.IntRange(1))
@click.option("--temperature", type=click.FloatRange(0, 2), help="0 for the most likely answer, every time.")
def ask(http: lc.Client, prompt: str, model, schema_file, max_output_tokens, temperature, as_json: bool) -> None:
    """Ask once; the answer streams to the terminal as it is generated."""
    fields = {"max_output_tokens": max_output_tokens, "temperature": temperature}
    if schema_file is not None:
        try:
            schema = json.load(schema_file)
        except ValueError as exc:
            fail(f"{schema_file.name} is not JSON: {exc}")
        name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(schema_file.name).stem)[:64] or "answer"
        fields["response_format"] = lc.json_schema_format(schema, name)
    if as_json:
        return print_json(http.create_response(prompt, model=model, **fields))
    final = None
    for event in http.stream_response(prompt, model=model, **fields):
        if event.name == lc.TEXT_DELTA:
            click.echo(event.data["delta"], nl=False)
            sys.stdout.flush()
        elif event.final:
            final = event
    click.echo()
    if final.name == "response.failed":
        error = final.data.get("error") or {}
        fail(f"generation failed: {error.get('detail', 'no detail')} ({error.get('code')})")
    if final.name == "response.incomplete":
        say(f"stopped early: {(final.data.get('incomplete_details') or {}).get('reason', 'incomplete')}")
    if final.name == "response.cancelled":
        fail("the response was cancelled")


# -- submit and tail ----------------------------------------------------------------------------------
@client_command(cli, "submit")
@click.argument("prompt")
@click.option("--model", help="Model id (default: the first ready one).")
@click.option("--max-output-tokens", type=click.IntRange(1))
@click.option("--on-restart", type=click.Choice(["fail", "retry", "resume"]),
              help="What a service restart does to the task (default: fail).")
@click.option("--follow", "-f", is_flag=True, help="Tail the task until it ends.")
@click.option("--idempotency-key", help="Default: a new random key.")
def submit(http: lc.Client, prompt, model, max_output_tokens, on_restart, follow, idempotency_key,
           as_json: bool) -> None:
    """Create a durable task; prints its id (with --follow, tails it)."""
    task = http.create_task(prompt, model=model, on_restart=on_restart, idempotency_key=idempotency_key,
                            max_output_tokens=max_output_tokens)
    if as_json and not follow:
        return print_json(task)
    if not follow:
        click.echo(task["id"])
        say(f"queued; `lmsp tail {task['id']}` follows it")
        return
    sys.exit(tail_task(http, task["id"], as_json))




def whole_column(header: str, values: list[str]):
    """A column whose values are whole at any width (80 columns, a pipe): an id is what the next command
    is given, and a state cut to "succeed…" says nothing."""
    from rich.table import Column
    return Column(header, no_wrap=True, min_width=max(map(len, [header, *values])))


# -- tasks --------------------------------------------------------------------------------------------
@client_command(tasks, "list")
@click.option("--state", help="Only these states, comma-separated (e.g. queued,running).")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
def tasks_list(http: lc.Client, state, limit: int, as_json: bool) -> None:
    """Your tasks, newest first."""
    rows = []
    for task in http.iter_tasks(state=state):
        rows.append(task)
        if len(rows) >= limit:
            break
    if as_json:
        return print_json(rows)
    from rich.table import Table
    table = Table(whole_column("TASK", [t["id"] for t in rows]), whole_column("STATE", [t["status"] for t in rows]),
                  "TOKENS", "DURATION", "CREATED", "ON RESTART", box=None)
    for t in rows:
        table.add_row(t["id"], styled(t["status"]), output_tokens(t), duration(t), ago(t["created_at"]),
                      t["on_restart"])
    rich_console().print(table)
    if not rows:
        say("no tasks yet; `lmsp submit \"...\"` creates one")


@client_command(tasks, "show")
@click.argument("task_id")
def tasks_show(http: lc.Client, task_id: str, as_json: bool) -> None:
    """One task and, once it succeeded, its result."""
    task = http.get_task(task_id)
    if as_json:
        return print_json(task)
    console = rich_console()
    from rich.table import Table
    facts = Table.grid(padding=(0, 2))
    facts.add_row("task", task["id"])
    facts.add_row("state", styled(task["status"]))
    facts.add_row("created", f"{ago(task['created_at'])} · took {duration(task)}")
    facts.add_row("on restart", task["on_restart"])
    usage = (task.get("response") or {}).get("usage")
    if usage:
        facts.add_row("tokens", f"{usage['output_tokens']} output, {usage['input_tokens']} input")
    if task.get("error"):
        facts.add_row("error", f"{task['error'].get('code')}: {task['error'].get('detail')}")
    if line := _timeline_line(task):
        facts.add_row("timeline", line)
    console.print(facts)
    if task["status"] == "succeeded":
        console.print()
        console.print(lc.output_text(task["response"]), markup=False)
    elif task["status"] not in lc.TERMINAL_STATES:
        say(f"not finished; `lmsp tail {task_id}` follows it")


TIMELINE_PHASES = ("queue", "retries", "dispatch", "load", "prefill", "decode", "write_lag")


def _timeline_line(task: dict) -> str | None:
    """Where a finished task's time went (its x-lmsp-timeline extension), the phases that took any."""
    timeline = (task.get("extensions") or {}).get("x-lmsp-timeline") or {}
    durations = timeline.get("durations")
    if not durations:
        return None
    parts = [f"{name.replace('_', ' ')} {_seconds(durations[name])}" for name in TIMELINE_PHASES
             if durations.get(name, 0) >= 0.0005]
    share = durations["framework_overhead"] / timeline["wall"] if timeline["wall"] else 0
    return " · ".join(parts) + f" (framework {_seconds(durations['framework_overhead'])}, {share:.1%})"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


@client_command(tasks, "cancel")
@click.argument("task_id")
def tasks_cancel(http: lc.Client, task_id: str, as_json: bool) -> None:
    """Cancel a task (a running one stops within moments)."""
    task = http.cancel_task(task_id)
    if as_json:
        return print_json(task)
    say(f"{task_id} is {task['status']}")

