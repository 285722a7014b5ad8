"""worker.gate.Deltas: a request's output handed from the engine loop to its consumer thread, merged
over the consumer's window, so the consumer wakes once a window rather than once a token."""

import asyncio
import threading
import time

import pytest

from worker.gate import STOP, Delta, Deltas


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
    got = []  # the window's end hands it over; without that, get() waits for a token that never comes
    consumer = threading.Thread(target=lambda: got.append(out.get()), daemon=True)
    consumer.start()
    consumer.join(5)
    assert [d.text for d in got] == ["b"]


# -- the middle handed over: taken on the loop thread, the consumer woken only for the end -----------
@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def _produce_on(loop, out: Deltas, texts: list[str], every: float, last: str | None = "stop", gap_at=None):
    """Each text a Delta put on the loop thread (as the engine's pump puts them), ``every`` s apart; a
    pause of ``gap_at[1]`` s before text ``gap_at[0]``."""
    def run():
        for k, text in enumerate(texts):
            time.sleep(gap_at[1] if gap_at and k == gap_at[0] else every)
            finish = last if k == len(texts) - 1 else None
            loop.call_soon_threadsafe(out.put, _delta(text, finish, 1.0 if k == 0 else None))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _consume(out: Deltas, handler) -> list:
    """As ``GatedHost.generate`` with ``on_delta``: the first Delta, then the middle handed over."""
    got = [out.get()]
    out.hand_over(handler)
    while True:
        item = out.get()
        got.append(item)
        if item is STOP or isinstance(item, BaseException) or item.finish_reason is not None:
            return got


def test_handed_over_the_middle_windows_go_to_the_handler_on_the_loop_thread_and_the_consumer_wakes_twice(loop):
    out = Deltas(window=0.1, loop=loop)
    taken = []
    _produce_on(loop, out, [f"{k} " for k in range(40)], 0.01)  # ~0.4 s
    got = _consume(out, lambda d: taken.append((threading.current_thread().name, d)))
    assert len(got) == 2 and got[0].text == "0 " and got[-1].finish_reason == "stop"  # the first, the end
    assert {name for name, _ in taken} == {"engine-loop"}
    text = got[0].text + "".join(d.text for _, d in taken) + got[-1].text
    assert text == "".join(f"{k} " for k in range(40))  # nothing lost, in order
    assert 2 <= len(taken) <= 6, [d.token_ids for _, d in taken]  # a call a window, not a token


def test_a_lone_token_in_the_middle_reaches_the_handler_at_its_window_end(loop):
    """No later Delta closes its window (the request is paused, or the engine slow): a timer does."""
    out = Deltas(window=0.1, loop=loop)
    taken = []
    # "b" comes shortly after "a" (inside a's window, so held), then nothing for 1 s.
    _produce_on(loop, out, ["a", "b", "c"], 0.01, gap_at=(2, 1.0))
    first = out.get()
    out.hand_over(lambda d: taken.append((time.monotonic(), d.text)))
    time.sleep(0.5)
    assert first.text == "a" and [text for _, text in taken] == ["b"]  # within its window, not after the pause
    assert out.get().text == "c"


def test_a_handler_that_says_stop_ends_the_stream_and_one_that_raises_hands_its_error_over(loop):
    out = Deltas(window=0.05, loop=loop)
    producer = _produce_on(loop, out, [f"{k} " for k in range(30)], 0.01)
    assert _consume(out, lambda d: False)[-1] is STOP
    producer.join()

    boom = ValueError("the builder refused it")
    out = Deltas(window=0.05, loop=loop)
    producer = _produce_on(loop, out, [f"{k} " for k in range(30)], 0.01)

    def refuse(d):
        raise boom
    assert _consume(out, refuse)[-1] is boom
    producer.join()


def test_unfollowed_windows_are_quiet_and_a_follower_gets_what_is_pending_at_once(loop):
    """A task's stream nobody follows live is merged over its quiet window (its cap grown as much); its
    audience (the writer's publish, or an api's hint) brings the short window back, pending tokens now."""
    out = Deltas(window=0.05, max_tokens=4, loop=loop, quiet=2.0)
    taken = []
    time.sleep(2.0 - time.monotonic() % 2.0 + 0.05)  # windows end on a 2 s grid: the next end is 2 s away
    # 40 tokens in 0.8 s, a pause of 1.5 s (the engine slow, or the request paused), 40 more.
    producer = _produce_on(loop, out, [f"{k} " for k in range(80)], 0.02, gap_at=(40, 1.5))
    first = out.get()
    out.hand_over(lambda d: taken.append((time.monotonic(), d.token_ids)))
    time.sleep(1.1)
    # At the short window a call every 4 tokens (~10 by now); the quiet window's cap is 160 tokens.
    quiet = list(taken)
    assert not quiet, quiet
    told = time.monotonic()
    out.audience(1, told)
    time.sleep(0.15)
    # What was pending went at once, though no token came to close its window.
    assert len(taken) == len(quiet) + 1 and taken[-1][0] - told < 0.1, (taken, told)
    assert sum(n for _, n in taken) == 39  # every token but the first so far
    producer.join()
    rest = out.get()
    assert rest.finish_reason == "stop" and len(taken) - len(quiet) - 1 >= 8, taken  # a call every 4 again
    assert sum(n for _, n in taken) + first.token_ids + rest.token_ids == 80


def test_a_stream_without_a_quiet_window_ignores_its_audience(loop):
    out = Deltas(window=0.05, loop=loop)
    assert out.followed
    out.audience(0, time.monotonic())
    assert out.followed


def test_a_publish_sent_before_a_followers_hint_does_not_quiet_its_stream_again(loop):
    """A publish sent just before a follower subscribed reaches nobody, and its reply can be heard after
    that follower's hint: older news than the hint, so the stream stays paced as followed."""
    out = Deltas(window=0.05, loop=loop, quiet=2.0)
    assert not out.followed
    sent = time.monotonic()
    out.audience(1, sent + 0.001)  # the hint, heard after the publish went out
    out.audience(0, sent)  # that publish's reply
    assert out.followed
    out.audience(0, sent + 0.002)  # a later publish reaching nobody: the follower has left
    assert not out.followed
