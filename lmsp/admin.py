"""Admin commands: migrate, tokens, and models (import, pull, the default)."""

from pathlib import Path

import click

from common.settings import get_settings
from lmsp.console import DEFAULT_MODEL, cli, fail, models, say, sessions, tokens


# ========================================================================================
def migrate() -> None:
    from common.db import shown_url, upgrade
    url = get_settings().db_url
    say(f"migrating {shown_url(url)}")
    upgrade(url)
    say("database is at the latest migration")


cli.command("migrate", help="Apply database migrations.")(migrate)


@tokens.command("create")
@click.option("--principal", required=True, help="The tenant the token acts for: 1-128 visible characters.")
@click.option("--scopes", help="Comma-separated; default: every 1.0 scope but admin.")
@click.option("--name", help="A label for `lmsp tokens list`: at most 200 characters.")
@click.option("--weight", type=float, help="The principal's share of each model's GPUs against other "
              "principals', by tokens (default 1; 2 gets twice the tokens of 1 while both wait). Sets it "
              "for the principal's every token.")
def tokens_create(principal: str, scopes: str | None, name: str | None, weight: float | None) -> None:
    """Create a token; prints it once."""
    from common.bus import mark_known
    from common.tokens import check_principal, check_weight, create_token, hash_secret, parse_scopes
    try:
        granted = parse_scopes(scopes)
        check_principal(principal, name)
        if weight is not None:
            check_weight(weight)
    except ValueError as exc:
        fail(str(exc))
    with sessions()() as session:
        token_id, secret = create_token(session, principal, granted, name, weight)
        session.commit()
    mark_known(get_settings().redis_url, hash_secret(secret))  # served even where bad tokens locked others out
    shared = "" if weight is None else f", weight {weight:g}"
    say(f"created token {token_id} for principal {principal} with scopes {' '.join(granted)}{shared}; "
        "it is shown only now")
    click.echo(secret)


@tokens.command("list")
def tokens_list() -> None:
    """List tokens (never their secrets)."""
    from common.tokens import list_tokens
    with sessions()() as session:
        rows = list_tokens(session)
    click.echo(f"{'ID':32} {'PRINCIPAL':20} {'WEIGHT':>6} {'NAME':16} {'STATE':8} SCOPES")
    for t, weight in rows:
        state = "revoked" if t.revoked_at else "active"
        click.echo(f"{t.id:32} {t.principal_id:20} {weight:>6g} {(t.name or '-'):16} {state:8} "
                   f"{t.scopes.replace(' ', ',')}")


@tokens.command("revoke")
@click.argument("token_id")
def tokens_revoke(token_id: str) -> None:
    """Revoke a token at once."""
    from common.bus import announce_revoked
    from common.tokens import revoke_token
    with sessions()() as session:
        found = revoke_token(session, token_id)
        session.commit()
    if not found:
        fail(f"no token {token_id}; `lmsp tokens list` shows them")
    settings = get_settings()
    if not settings.redis_url:  # the api's caches hear of a revoke over Redis: this command has none to tell
        say(f"revoked {token_id}; LMSP_REDIS_URL is not set here, so an api that uses Redis refuses it within "
            f"LMSP_TOKEN_CACHE_SECONDS ({settings.token_cache_seconds:g} s), not at once: run this with the "
            "api's LMSP_REDIS_URL for that")
        return
    if not announce_revoked(settings.redis_url, token_id):  # committed first: the api may look it up now
        say(f"revoked {token_id}; Redis is unreachable, so the api processes refuse it within "
            f"LMSP_TOKEN_CACHE_SECONDS ({settings.token_cache_seconds:g} s), not at once")
        return
    say(f"revoked {token_id}")


def import_gguf(path: Path, model_id: str, *, reasoning_parser=None, tool_call_parser=None) -> None:
    from common.gguf import convert_gguf
    from common.registry import Capabilities, ModelSpec, Registry, imported_dir

    settings = get_settings()
    out = imported_dir(model_id)
    info = convert_gguf(path, out, say)
    window = min(info["context_window"], 8192)
    registry = Registry.load(settings.models_path)
    registry.put(ModelSpec(
        id=model_id, checkpoint=str(out), context_window=window, max_output_tokens=min(window, 4096),
        engine={"dtype": "auto", "max_model_len": window, "max_num_seqs": 64, "enforce_eager": True},
        capabilities=Capabilities(reasoning=reasoning_parser is not None),
        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser))
    registry.save(settings.models_path)
    say(f"registered {model_id} in {settings.models_path}")


@models.command("import-gguf")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--id", "model_id", required=True)
@click.option("--reasoning-parser", type=click.Choice(["think"]))
@click.option("--tool-call-parser", type=click.Choice(["hermes"]))
def models_import(file: Path, model_id: str, reasoning_parser, tool_call_parser) -> None:
    """Convert a GGUF file (Ollama, llama.cpp) to a checkpoint vLLM loads, and register it."""
    if not file.is_file():
        fail(f"no file {file}")
    try:
        import_gguf(file, model_id, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
    except (OSError, ValueError) as exc:  # not a GGUF file, an architecture transformers cannot read, ...
        fail(f"cannot import {file}: {str(exc).rstrip('.')}; give a GGUF file as Ollama or llama.cpp keep them")


@models.command("pull")
@click.argument("model_ids", metavar="[ID]...", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every model of the registry.")
@click.option("--tokenizer-only", is_flag=True,
              help="Only what the api needs (tokenizer, chat template, config): no weights.")
@click.option("--keep-going", is_flag=True,
              help="Try every model even when one fails; list the failures and exit 0 (the api serves "
                   "the models it has and answers 503 model_unavailable for the others).")
@click.option("--update", is_flag=True,
              help="A hub model without a pinned revision: take its branch's newest commit and record it "
                   "for every host (by default every host takes the commit the first pull recorded).")
def models_pull(model_ids: tuple[str, ...], every: bool, tokenizer_only: bool, keep_going: bool,
                update: bool) -> None:
    """Bring models' files onto this machine: a Hugging Face repo id into the shared cache (HF_HOME;
    resumable, HF_TOKEN for gated repos, HF_HUB_OFFLINE=1 uses the cache alone), a GGUF file converted.
    Prints each model's local folder; the api and the workers load from that same folder."""
    from common.errors import LMSPError
    from common.registry import CheckpointMissing, Registry, pull, source_of
    registry = Registry.load(get_settings().models_path)
    if every == bool(model_ids):
        fail("name the models to pull, or give --all (`lmsp models list --registry` shows them)")
    specs = list(registry.models.values()) if every else []
    for model_id in model_ids:
        try:
            specs.append(registry.get(model_id))
        except LMSPError as exc:
            fail(f"{exc.detail.split(';')[0]} in {get_settings().models_path}; "
                 "`lmsp models list --registry` shows them")
    failed = []
    for spec in specs:
        say(f"{spec.id}: {source_of(spec).describe()}")
        try:
            folder = pull(spec, tokenizer_only=tokenizer_only, progress=say, update=update)
        except CheckpointMissing as exc:
            if not keep_going:
                fail(str(exc))
            say(f"not pulled: {exc}")
            failed.append(spec.id)
            continue
        if source_of(spec).kind == "hub":
            say(f"{spec.id}: commit {Path(folder).name}" + ("" if spec.revision else
                " (on record in the database: every host that pulls it takes this one)"))
        click.echo(f"{spec.id}\t{folder}")
    if failed:
        say(f"{len(failed)} of {len(specs)} models not pulled ({', '.join(failed)}): requests for them get "
            "503 model_unavailable until a pull succeeds; the lines above say what to fix, `lmsp doctor` "
            "lists what is missing")


@models.command("fetch-default", help=f"Fetch and import the default model, {DEFAULT_MODEL}.")
def models_default() -> None:
    from common.gguf import fetch_default_gguf
    import_gguf(fetch_default_gguf(get_settings().home / "downloads", say), DEFAULT_MODEL)
