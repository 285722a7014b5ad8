"""A response's topic (api/live/topics.py): its sample for a poll is a live follower, never one that
reads the log (whose own reads cover it)."""

from api.live.follower import LIVE, REPLAY
from api.live.topics import Recent, Topic


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


# --- a topic's recent events: a follower attaching within them is served without a read -------------------
def _ev(seq: int, name: str = "response.output_text.delta", size: int = 10) -> tuple[int, str, str]:
    return seq, name, "x" * size


def _seqs(recent) -> list[int]:
    return [e[0] for e in recent.events]


def test_the_run_goes_on_with_what_is_heard_and_starts_again_at_a_gap():
    recent = Recent()
    recent.heard([_ev(3), _ev(4)])
    recent.heard([_ev(4), _ev(5)])  # one heard twice (a poll's page and the channel): kept once
    assert _seqs(recent) == [3, 4, 5]
    assert recent.since(1) is None  # before the run: not known here
    batch, final = recent.since(3)
    assert [e[0] for e in batch.events] == [4, 5] and not final
    recent.heard([_ev(7)])  # 6 was lost on the channel: the run holds only what follows the gap
    assert _seqs(recent) == [7]
    assert recent.since(5) is None


def test_one_read_seeds_the_run_and_the_followers_that_came_meanwhile_wait_for_it():
    recent = Recent()
    assert recent.plan("a", 0) == (Recent.SEED,)
    assert recent.plan("b", 0) == (Recent.WAIT,)
    assert recent.plan("c", 4) == (Recent.WAIT,)
    recent.heard([_ev(6), _ev(7)])  # heard while the read ran
    assert recent.seeded([_ev(1), _ev(2), _ev(3), _ev(4), _ev(5), _ev(6)]) == ["b", "c"]
    assert _seqs(recent) == list(range(1, 8))
    plan, batch, final = recent.plan("d", 2)
    assert plan == Recent.SERVED and [e[0] for e in batch.events] == [3, 4, 5, 6, 7] and not final
    late = Recent()
    assert late.plan("a", 5) == (Recent.SEED,)
    assert late.plan("b", 2) == (Recent.READ,)  # before the seed's point: it would not cover it


def test_a_seed_that_does_not_meet_the_run_or_outlived_a_transport_change_is_not_kept():
    gapped = Recent()
    gapped.plan("a", 0)
    gapped.heard([_ev(9)])
    assert gapped.seeded([_ev(1), _ev(2)]) == []  # 3-8 known to neither: the run after the gap stays alone
    assert _seqs(gapped) == [9]
    changed = Recent()
    changed.plan("a", 0)
    changed.forget()  # Redis came or went while the read ran: what it missed may be lost
    assert changed.seeded([_ev(1), _ev(2)]) == [] and _seqs(changed) == []
    failed = Recent()
    failed.plan("a", 0)
    failed.plan("b", 0)
    assert failed.seeded(None) == ["b"] and _seqs(failed) == []  # the waiter reads for itself


def test_the_run_ends_at_the_final_event_and_a_resume_past_it_ends_at_once():
    recent = Recent()
    recent.heard([_ev(1), _ev(2), _ev(3, "response.completed")])
    batch, final = recent.since(1)
    assert [e[0] for e in batch.events] == [2, 3] and final
    assert recent.since(3) == (None, True)
    running = Recent()
    running.heard([_ev(1), _ev(2)])
    assert running.since(2) == (None, False)  # at the head: live from here


def test_the_run_is_bounded_and_a_topic_keeps_none_until_a_task_follower_attaches(monkeypatch):
    monkeypatch.setattr("api.live.topics.RECENT_BYTES", 100)
    recent = Recent()
    recent.heard([_ev(seq, size=30) for seq in range(1, 11)])
    assert recent.bytes <= 100 and _seqs(recent) == [8, 9, 10]
    assert recent.since(0) is None
    assert Topic("resp_1").recent is None  # a direct stream's or a long poll's: nothing kept (Hub._add)
