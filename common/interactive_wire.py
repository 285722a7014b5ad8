"""The interactive lane's wire: one plain kombu message per ``POST /responses``.

The api sends it (``send``), worker/interactive.py drains it (``decode``). It is not a
Celery task: the payload is this module's, so neither side depends on Celery's protocol.
"""

from kombu import Exchange, Queue

VERSION = 1


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def encode(response_id: str, prompt_ids: list[int] | None = None, logged: bool = False) -> dict:
    """``prompt_ids``: the prompt as the api tokenized it for the context check, so the worker need not
    render and tokenize it again (a copy sent later may go without: the worker then renders it).
    ``logged``: the api's stream could not subscribe to the response's channel (Redis away or slow to
    confirm), so the worker writes its events to the log too, where the stream reads what it missed."""
    body = {"v": VERSION, "response_id": response_id}
    if prompt_ids is not None:
        body["prompt_ids"] = prompt_ids
    if logged:
        body["logged"] = True
    return body


def decode(body) -> str:
    """The response id of a message, or ValueError for anything else."""
    if not isinstance(body, dict) or body.get("v") != VERSION or not isinstance(body.get("response_id"), str):
        raise ValueError(f"not an interactive message: {body!r:.200}")
    return body["response_id"]


def logged(body: dict) -> bool:
    return body.get("logged") is True


def prompt_ids(body: dict) -> list[int] | None:
    ids = body.get("prompt_ids")
    return ids if isinstance(ids, list) and ids and all(type(i) is int for i in ids) else None


RETRY_ONCE = {"max_retries": 1, "interval_start": 0, "interval_step": 0, "interval_max": 0}


def send(celery, queue_name: str, response_id: str, prompt_ids: list[int] | None = None,
         logged: bool = False) -> None:
    q = queue(queue_name)
    with celery.producer_or_acquire() as producer:  # the app's pooled connection
        # Straight to the queue (the default exchange), not through the exchange's binding table in Redis:
        # after a FLUSHALL on a live connection kombu still believes the table declared and routes the
        # message nowhere, silently, for this and every re-send (the chaos run found direct responses
        # left queued forever that way).
        # One retry, at once: it revives a pooled connection a Redis restart broke. Without a policy kombu
        # retried for as long as the broker was away, and a synchronous request never answered.
        producer.publish(encode(response_id, prompt_ids, logged), exchange="", routing_key=q.name, declare=[q],
                         serializer="json", retry=True, retry_policy=RETRY_ONCE)
