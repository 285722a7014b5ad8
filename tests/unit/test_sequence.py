"""One numbering of a response's events (common/events.py ``Sequence``): 1, 2, ... with no gap."""

import json

from common import events
from common.events import Sequence


def test_numbers_follow_on_without_a_gap_and_encode_once():
    seq = Sequence.opened()  # a task: create_task logged response.created as #1
    first = seq.number([(events.TEXT_DELTA, {"delta": "a"}), (events.TEXT_DELTA, '{"delta":"b"}')])
    assert [s for s, _, _ in first] == [2, 3] and seq.last == 3 and seq.next == 4
    assert json.loads(first[0][2]) == {"delta": "a"} and first[1][2] == '{"delta":"b"}'  # encoded: kept as is
    assert seq.number([]) == [] and seq.last == 3
    obj = {"id": "resp_1", "object": "response", "status": "in_progress"}
    assert events.opening(obj) == (1, events.CREATED, events.dumps(events.created("resp_1", obj)))
    assert Sequence().number([(events.CREATED, {})])[0][0] == 1  # a direct response numbers #1 itself
