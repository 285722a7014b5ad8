"""worker.gate.Deltas: a request's output handed from the engine loop to its consumer thread, merged
over the consumer's window, so the consumer wakes once a window rather than once a token."""

import threading
import time

from worker.gate import Delta, Deltas


def _delta(text: str, finish: str | None = None, admitted_at: float | None = None) -> Delta:
    return Delta(text=text, token_ids=1, finish_reason=finish, prompt_tokens=3, admitted_at=admitted_at)


def _produce(out: Deltas, n: int, every: float, error: BaseException | None = None) -> threading.Thread:
    def run():
        for k in range(n):
            time.sleep(every)
            out.put(_delta(f"{k} ", "stop" if k == n - 1 and error is None else None, 1.0 if k == 0 else None))
        if error is not None:
            out.put(error)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _drain(out: Deltas) -> list:
    got = []
    while True:
        item = out.get()
        got.append((time.monotonic(), item))
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return got


def test_tokens_are_merged_over_the_window_and_the_first_and_last_come_at_once():
    out = Deltas(window=0.2)
    started = time.monotonic()
    _produce(out, 60, 0.01)  # ~0.6 s of tokens
    got = _drain(out)
    deltas = [d for _, d in got]
    assert "".join(d.text for d in deltas) == "".join(f"{k} " for k in range(60))  # nothing lost, in order
    assert sum(d.token_ids for d in deltas) == 60 and deltas[-1].finish_reason == "stop"
    assert deltas[0].token_ids == 1 and got[0][0] - started < 0.1  # the first token at once (time to first token)
    assert deltas[0].admitted_at == 1.0
    assert len(deltas) <= 6, [d.token_ids for d in deltas]  # a wake-up a window, not 60
    assert got[-1][0] - started < 0.6 + 0.15  # the final one is not held for the window


def test_without_a_window_every_delta_is_its_own():
    out = Deltas()
    _produce(out, 5, 0.02)
    assert [d.text for _, d in _drain(out)] == [f"{k} " for k in range(5)]


def test_a_token_cap_ends_a_window_early():
    out = Deltas(window=10.0, max_tokens=4)
    _produce(out, 12, 0.005)
    deltas = [d for _, d in _drain(out)]
    assert sum(d.token_ids for d in deltas) == 12 and all(d.token_ids <= 5 for d in deltas[1:])


def test_an_error_comes_after_the_text_before_it():
    out = Deltas(window=10.0)
    boom = RuntimeError("engine died")
    _produce(out, 3, 0.01, error=boom)
    first, merged, error = out.get(), out.get(), out.get()
    assert first.text == "0 " and merged.text == "1 2 " and error is boom


def test_a_window_with_no_token_yet_is_not_lost_when_tokens_stop():
    """A consumer that asked before its window ended and then got one token (a paused request's last
    for a while) has it at the window's end, not at the next token."""
    out = Deltas(window=0.1)
    out.put(_delta("a"))
    assert out.get().text == "a"
    threading.Timer(0.02, out.put, args=(_delta("b"),)).start()
    started = time.monotonic()
    assert out.get().text == "b" and time.monotonic() - started < 0.5
