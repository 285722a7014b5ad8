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
