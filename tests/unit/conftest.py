"""The unit layer: the real api (create_app, Flask test client) on a SQLite file, a filesystem broker and
no Redis, with the default checkpoint's real tokenizer for context counting; no engine, no worker."""

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from common import eventlog, events
from common.db import make_engine, session_factory, upgrade
from common.settings import Settings
from common.tables import Response, Task
from common.tokens import SCOPES, create_token
from tests import factories
from tests.harness import CHECKPOINT, model_entry, user

MODEL = "smollm2:unit"      # every capability, the real tokenizer
NARROW = "tiny:unit"        # a small window and none of the optional capabilities


@dataclass
class Unit:
    app: object
    client: object
    settings: Settings
    sessions: object

    def token(self, principal: str, *scopes: str) -> str:
        with self.sessions() as session:
            _, secret = create_token(session, principal, scopes or SCOPES)
            session.commit()
        return secret

    def as_(self, principal: str, *scopes: str) -> "Caller":
        return Caller(self, self.token(principal, *scopes), principal)

    @property
    def anonymous(self) -> "Caller":
        return Caller(self, None, "")


@dataclass
class Caller:
    unit: Unit
    secret: str | None
    principal: str

    def open(self, method: str, path: str, **kw):
        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        headers.update(kw.pop("headers", {}))
        return self.unit.client.open(path, method=method, headers=headers, **kw)

    def get(self, path: str, **kw):
        return self.open("GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return self.open("POST", path, json=body, **kw) if body is not None else self.open("POST", path, **kw)

    def task(self, status: str = "queued", *, response: dict | None = None, **values) -> Task:
        """A task row of this principal in ``status`` with ``values``, and ``response`` values on its
        response row, as a worker would have left them."""
        with self.unit.sessions() as session:
            row = factories.task(session, status, owner=self.principal, model=MODEL)
            for target, changes in ((row, values), (session.get(Response, row.response_id), response or {})):
                for key, value in changes.items():
                    setattr(target, key, value)
            session.commit()
        return row

    def log(self, task: Task, batch: list[events.EventData], first: int = 1) -> None:
        """Append events to the task's log, numbered from ``first``."""
        with self.unit.sessions() as session:
            eventlog.append(session, task.response_id, events.Sequence(first - 1).number(batch))
            session.commit()


def unit_settings(home: Path, **overrides) -> Settings:
    models = home / "models.yaml"
    no_extras = {"tools": False, "structured_output": False, "conversations": False, "resume_snapshots": False}
    models.write_text(yaml.safe_dump({"models": [
        model_entry(MODEL), model_entry(NARROW, context_window=64, max_output_tokens=16, capabilities=no_extras)]}))
    # Explicit database/broker/redis so LMSP_* variables of the surrounding shell cannot leak in.
    values = {"home": home, "models_file": models, "database_url": f"sqlite:///{home / 'lmsp.db'}",
              "broker_url": "", "redis_url": "", "rate_limit_per_second": 1e6, "rate_limit_burst": 10**6,
              **overrides}
    return Settings(**values)


def make_unit(home: Path, **overrides) -> Unit:
    from api import create_app

    settings = unit_settings(home, **overrides)
    upgrade(settings.db_url)
    app = create_app(settings)
    return Unit(app, app.test_client(), settings, session_factory(make_engine(settings.db_url)))


@pytest.fixture(scope="session")
def unit(tmp_path_factory) -> Unit:
    if not (CHECKPOINT / "tokenizer.json").exists():
        pytest.skip(f"no checkpoint at {CHECKPOINT} (make model)")
    return make_unit(tmp_path_factory.mktemp("unit"))


@pytest.fixture
def alice(unit) -> Caller:
    return unit.as_(f"alice-{time.monotonic_ns()}")


@pytest.fixture
def bob(unit) -> Caller:
    return unit.as_(f"bob-{time.monotonic_ns()}")


def request_body(model: str = MODEL, **fields) -> dict:
    return {"model": model, "input": user("hi"), **fields}


def task_body(model: str = MODEL, **fields) -> dict:
    return {"type": "response", "input": request_body(model, **fields)}


def problem(resp, status: int, code: str) -> dict:
    """The answer is the problem document of ``code`` (spec 9.3)."""
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.mimetype == "application/problem+json"
    doc = resp.get_json()
    assert doc["code"] == code and doc["status"] == status, doc
    assert doc["type"] == f"/lmsp/v1/errors#{code}" and doc["title"] and doc["detail"]
    assert doc["message"] == doc["detail"]  # what OpenAI's clients show of an error
    # what the OpenAI Node SDK reads its exception from (only this member)
    assert doc["error"] == {"message": doc["detail"], "code": code, "param": doc.get("param"),
                            "type": {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                                     429: "rate_limit_error"}.get(status, "server_error" if status >= 500
                                                                  else "invalid_request_error")}, doc
    assert resp.headers["LMSP-Version"] == "1.0"
    return doc
