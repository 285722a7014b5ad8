"""A response's topic (api/live/topics.py): its sample for a poll is a live follower, never one that
reads the log (whose own reads cover it)."""

from api.live.follower import LIVE, REPLAY
from api.live.topics import Topic


class Member:
    def __init__(self, state, began):
        self.state, self.began = state, began


def test_a_poll_samples_a_live_follower_only():
    topic = Topic("resp_1")
    reading = Member(REPLAY, True)
    waiting = Member(LIVE, False)
    topic.followers |= {reading, waiting}
    assert topic.sample() is None
    live = Member(LIVE, True)
    topic.followers.add(live)
    assert topic.sample() is live


# --- a topic's recent events: a follower attaching near the head is served without a read ----------------
def _ev(seq: int, name: str = "response.output_text.delta", size: int = 10) -> tuple[int, str, str]:
    return seq, name, "x" * size


def test_the_run_goes_on_with_what_is_heard_and_starts_again_at_a_gap():
    topic = Topic("resp_1")
    topic.heard([_ev(3), _ev(4)])
    topic.heard([_ev(4), _ev(5)])  # one heard twice (a poll's page and the channel): kept once
    assert [e[0] for e in topic.recent] == [3, 4, 5]
    assert topic.since(1) is None  # before the run: not known here
    batch, final = topic.since(3)
    assert [e[0] for e in batch.events] == [4, 5] and not final
    topic.heard([_ev(7)])  # 6 was lost on the channel: the run holds only what follows the gap
    assert [e[0] for e in topic.recent] == [7]
    assert topic.since(5) is None


def test_a_page_read_after_the_subscription_goes_in_front_of_the_run_when_they_meet():
    topic = Topic("resp_1")
    topic.heard([_ev(6), _ev(7)])
    topic.seed([_ev(1), _ev(2), _ev(3), _ev(4), _ev(5), _ev(6)])
    assert [e[0] for e in topic.recent] == list(range(1, 8))
    batch, final = topic.since(0)
    assert [e[0] for e in batch.events] == list(range(1, 8)) and not final
    gapped = Topic("resp_2")
    gapped.heard([_ev(9)])
    gapped.seed([_ev(1), _ev(2)])  # 3-8 known to neither: the run after the gap stays alone
    assert [e[0] for e in gapped.recent] == [9]


def test_the_run_ends_at_the_final_event_and_a_resume_past_it_ends_at_once():
    topic = Topic("resp_1")
    topic.heard([_ev(1), _ev(2), _ev(3, "response.completed")])
    batch, final = topic.since(1)
    assert [e[0] for e in batch.events] == [2, 3] and final
    assert topic.since(3) == (None, True)
    running = Topic("resp_2")
    running.heard([_ev(1), _ev(2)])
    assert running.since(2) == (None, False)  # at the head: live from here


def test_the_run_is_bounded_and_a_notices_topic_keeps_none(monkeypatch):
    monkeypatch.setattr("api.live.topics.RECENT_BYTES", 100)
    topic = Topic("resp_1")
    topic.heard([_ev(seq, size=30) for seq in range(1, 11)])
    assert topic.recent_bytes <= 100 and [e[0] for e in topic.recent] == [8, 9, 10]
    assert topic.since(0) is None
    notices = Topic("notices:resp_1")
    notices.heard([_ev(1)])
    assert notices.recent is None and notices.since(0) is None
