"""The followers' log reads (api/live/reads.py): a page stops at the final event; "has it ended" is
asked only when the log has nothing new, and the log is read again after its answer."""

from api.live import reads
from api.live.reads import LogReader
from common import events


def _script(rid):
    return [events.ResponseCreated(response_id=rid), events.TextDelta(response_id=rid, output_index=0, item_id="m", delta="a"),
            events.final(rid, "completed", usage={}),
            events.TextDelta(response_id=rid, output_index=0, item_id="m", delta="stray")]


def test_a_page_ends_at_the_final_event(unit, alice, monkeypatch):
    task = alice.task("succeeded")
    alice.log(task, _script(task.response_id))
    reader = LogReader(unit.app.extensions["lmsp"].reads, lambda fn, *a: fn(*a))
    page, final = reader.page(task.response_id, 0)
    assert [seq for seq, _, _ in page] == [1, 2, 3] and final
    monkeypatch.setattr(reads, "PAGE", 2)
    page, final = reader.page(task.response_id, 0)
    assert [seq for seq, _, _ in page] == [1, 2] and not final


def test_ended_is_asked_only_when_the_log_has_nothing_new(unit, alice):
    task = alice.task("running")
    alice.log(task, _script(task.response_id)[:2])
    reader = LogReader(unit.app.extensions["lmsp"].reads, lambda fn, *a: fn(*a))
    asked = []

    def ended():
        asked.append(1)
        return []
    page, final, ending = reader.ask(task.response_id, 0, True, ended, None)
    assert len(page) == 2 and ending is None and not asked
    page, final, ending = reader.ask(task.response_id, 2, True, ended, None)
    assert page == [] and ending == [] and asked == [1]
