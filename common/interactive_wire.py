"""The interactive lane's wire: one plain kombu message per ``POST /responses``.

The api sends it (``send``), worker/interactive.py drains it (``decode``). It is not a
Celery task: the payload is this module's, so neither side depends on Celery's protocol.
"""

from kombu import Exchange, Queue

VERSION = 1


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def encode(response_id: str) -> dict:
    return {"v": VERSION, "response_id": response_id}


def decode(body) -> str:
    """The response id of a message, or ValueError for anything else."""
    if not isinstance(body, dict) or body.get("v") != VERSION or not isinstance(body.get("response_id"), str):
        raise ValueError(f"not an interactive message: {body!r:.200}")
    return body["response_id"]


def send(celery, queue_name: str, response_id: str) -> None:
    q = queue(queue_name)
    with celery.producer_or_acquire() as producer:  # the app's pooled connection
        # Straight to the queue (the default exchange), not through the exchange's binding table in Redis:
        # after a FLUSHALL on a live connection kombu still believes the table declared and routes the
        # message nowhere, silently, for this and every re-send (the chaos run found direct responses
        # left queued forever that way).
        producer.publish(encode(response_id), exchange="", routing_key=q.name, declare=[q],
                         serializer="json", retry=True)
