"""The ``lmsp`` command. Results go to stdout, progress and messages to stderr.

``serve`` and ``worker`` start their programs as separate processes, so this
module never imports ``api`` or ``worker`` itself.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.settings import get_settings

DEFAULT_MODEL = "smollm2:135m"


def say(message: str) -> None:
    print(f"lmsp: {message}", file=sys.stderr, flush=True)


def _sessions():
    from common.db import NotMigrated, ensure_migrated, make_engine, session_factory
    engine = make_engine(get_settings().db_url)
    try:
        ensure_migrated(engine)
    except NotMigrated as exc:
        sys.exit(f"lmsp: {exc}")
    return session_factory(engine)


# -- migrate -----------------------------------------------------------------------------
def cmd_migrate(_args) -> None:
    from common.db import upgrade
    url = get_settings().db_url
    say(f"migrating {re.sub(r'//[^@/]*@', '//***@', url)}")
    upgrade(url)
    say("database is at the latest migration")


# -- tokens --------------------------------------------------------------------------------
def cmd_tokens_create(args) -> None:
    from common.tokens import create_token, parse_scopes
    try:
        scopes = parse_scopes(args.scopes)
    except ValueError as exc:
        sys.exit(f"lmsp: {exc}")
    with _sessions()() as session:
        token_id, secret = create_token(session, args.principal, scopes, args.name)
        session.commit()
    say(f"created token {token_id} for principal {args.principal} with scopes {' '.join(scopes)}; "
        "it is shown only now")
    print(secret)


def cmd_tokens_list(_args) -> None:
    from common.tokens import list_tokens
    with _sessions()() as session:
        rows = list_tokens(session)
    print(f"{'ID':32} {'PRINCIPAL':20} {'NAME':16} {'STATE':8} SCOPES")
    for t in rows:
        state = "revoked" if t.revoked_at else "active"
        print(f"{t.id:32} {t.principal_id:20} {(t.name or '-'):16} {state:8} {t.scopes.replace(' ', ',')}")


def cmd_tokens_revoke(args) -> None:
    from common.tokens import revoke_token
    with _sessions()() as session:
        found = revoke_token(session, args.id)
        session.commit()
    if not found:
        sys.exit(f"lmsp: no token {args.id}; `lmsp tokens list` shows them")
    say(f"revoked {args.id}")


# -- models ---------------------------------------------------------------------------------
def _model_dir(model_id: str) -> Path:
    return get_settings().model_cache / re.sub(r"[^A-Za-z0-9_.-]", "-", model_id)


def import_gguf(path: Path, model_id: str, *, reasoning_parser=None, tool_call_parser=None) -> None:
    from common.gguf import convert_gguf
    from common.registry import Capabilities, ModelSpec, Registry

    settings = get_settings()
    out = _model_dir(model_id)
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


def cmd_models_import(args) -> None:
    path = Path(args.file)
    if not path.is_file():
        sys.exit(f"lmsp: no file {path}")
    import_gguf(path, args.id, reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)


def cmd_models_default(_args) -> None:
    from common.gguf import fetch_default_gguf
    settings = get_settings()
    gguf = fetch_default_gguf(settings.home / "downloads", say)
    import_gguf(gguf, DEFAULT_MODEL)


def cmd_models_list(_args) -> None:
    from common.registry import Registry, detect_machine, resolve_engine
    machine = detect_machine()  # engine settings as a worker on this machine resolves them
    for spec in Registry.load(get_settings().models_path).models.values():
        print(f"{spec.id}\t{spec.checkpoint}\tcontext={spec.context_window}\t"
              f"{resolve_engine(spec, machine).summary()}")


# -- processes ---------------------------------------------------------------------------------
def cmd_serve(_args) -> None:
    from api.serve import gunicorn_argv
    argv = gunicorn_argv(get_settings())
    os.execv(argv[0], argv)


def cmd_worker(args) -> None:
    argv = [sys.executable, "-m", "worker", "--model", args.model]
    if args.gpu is not None:
        argv += ["--gpu", str(args.gpu)]
    os.execv(argv[0], argv)


def _interrupt(*_):
    raise KeyboardInterrupt


def cmd_dev(_args) -> None:
    """api + one worker per model on this machine, with no Postgres or Redis."""
    from common.registry import Registry
    settings = get_settings()
    cmd_migrate(None)
    models = list(Registry.load(settings.models_path).models)
    if not models:
        sys.exit("lmsp: no models registered; run `make model` (or `lmsp models import-gguf FILE --id ID`)")
    token_file = settings.home / "dev-token"
    if not token_file.exists():
        from common.tokens import DEFAULT_SCOPES, create_token
        with _sessions()() as session:
            _, secret = create_token(session, "dev", DEFAULT_SCOPES, "dev")
            session.commit()
        token_file.touch(mode=0o600)
        token_file.write_text(secret + "\n")
    say(f"a token for principal 'dev' is in {token_file}")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children on SIGTERM too, not only Ctrl-C
    children = [subprocess.Popen([sys.executable, "-m", "worker", "--model", m]) for m in models]
    from api.serve import gunicorn_argv
    api = subprocess.Popen(gunicorn_argv(settings))
    children.append(api)
    say(f"serving on http://{settings.host}:{settings.port} (models load in ~1 minute; Ctrl-C stops)")
    try:
        while all(c.poll() is None for c in children):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children:
            try:
                c.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lmsp", description="LMSP 1.0 task service")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the api (gunicorn, gthread)").set_defaults(fn=cmd_serve)
    p = sub.add_parser("worker", help="run a worker for one model")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", type=int)
    p.set_defaults(fn=cmd_worker)
    sub.add_parser("dev", help="api + workers on this machine, no Postgres or Redis").set_defaults(fn=cmd_dev)
    sub.add_parser("migrate", help="apply database migrations").set_defaults(fn=cmd_migrate)

    models = sub.add_parser("models", help="the model registry").add_subparsers(dest="action", required=True)
    p = models.add_parser("import-gguf", help="convert a GGUF file and register it")
    p.add_argument("file")
    p.add_argument("--id", required=True)
    p.add_argument("--reasoning-parser", choices=["think"])
    p.add_argument("--tool-call-parser", choices=["hermes"])
    p.set_defaults(fn=cmd_models_import)
    models.add_parser("fetch-default", help=f"fetch and import {DEFAULT_MODEL}").set_defaults(fn=cmd_models_default)
    models.add_parser("list").set_defaults(fn=cmd_models_list)

    tokens = sub.add_parser("tokens", help="API tokens").add_subparsers(dest="action", required=True)
    p = tokens.add_parser("create", help="create a token; prints it once")
    p.add_argument("--principal", required=True)
    p.add_argument("--scopes", help="comma-separated; default: every 1.0 scope but admin")
    p.add_argument("--name")
    p.set_defaults(fn=cmd_tokens_create)
    tokens.add_parser("list").set_defaults(fn=cmd_tokens_list)
    p = tokens.add_parser("revoke")
    p.add_argument("id")
    p.set_defaults(fn=cmd_tokens_revoke)

    args = parser.parse_args(argv)
    args.fn(args)




if __name__ == "__main__":
    main()
