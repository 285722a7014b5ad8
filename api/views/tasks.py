import json

from flask import Blueprint, Response, request
from sqlalchemy.exc import IntegrityError

from api.auth import principal, require
from api.body import json_body
from api.extensions import services
from api.services import idempotency
from api.services.validation import prepare
from api.services.work import cancel_task, check_task_limits, get_task, new_task, send_task, task_view
from common.errors import LMSPError
from common.protocol import TaskRequest, parse

bp = Blueprint("tasks", __name__, url_prefix="/lmsp/v1/tasks")


def _accepted(doc: dict) -> Response:
    return Response(json.dumps(doc), status=202, mimetype="application/json",
                    headers={"Location": f"/lmsp/v1/tasks/{doc['id']}"})


@bp.post("")
@require("tasks:write")
def create():
    svc = services()
    body = json_body()
    who = principal()
    envelope = parse(TaskRequest, body)
    key = idempotency.key_from(request.headers.get("Idempotency-Key"), who, "POST", request.path, body)
    with svc.sessions() as session:
        if key is not None and (record := idempotency.existing(session, key)) is not None:
            return _replay(session, who, idempotency.check_replay(record, key))
        try:
            prepared = prepare(session, svc, who, {**body["input"], "stream": False})
        except LMSPError as exc:
            exc.param = f"input.{exc.param}" if exc.param else exc.param  # the field is inside the envelope
            raise
        check_task_limits(svc, session, who, prepared)
        task = new_task(session, who, prepared, envelope.on_restart)
        if key is not None:
            # Same transaction as the task: a task exists exactly when its key is recorded.
            session.add(idempotency.record_for_insert(key, status_code=202, task_id=task.id))
        try:
            session.commit()
        except IntegrityError:
            session.rollback()  # a concurrent request with the same key won the race
            record = idempotency.existing(session, key) if key is not None else None
            if record is None:
                raise
            return _replay(session, who, idempotency.check_replay(record, key))
        doc = task_view(session, task, svc.registry)
    send_task(svc, task)
    return _accepted(doc)


def _replay(session, who, record) -> Response:
    return _accepted(task_view(session, get_task(session, who, record.task_id), services().registry))


@bp.get("/<task_id>")
@require("tasks:read")
def get(task_id: str):
    svc = services()
    with svc.sessions() as session:
        return task_view(session, get_task(session, principal(), task_id), svc.registry)


@bp.post("/<task_id>/cancel")
@require("tasks:cancel")
def cancel(task_id: str):
    return cancel_task(services(), principal(), task_id)


