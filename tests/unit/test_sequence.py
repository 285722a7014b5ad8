"""One numbering of a response's events (common/events.py ``Sequence``): 1, 2, ... with no gap; and each
event's data as its struct encodes it, byte for byte what the dict builders sent before them."""

import json

import pytest

from common import events
from common.events import Sequence

RID, ITEM = "resp_1", {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
USAGE = {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3}
PROBLEM = {"type": "/lmsp/v1/errors#server_restarted", "code": "server_restarted"}
OBJ = {"id": RID, "object": "response", "status": "in_progress"}


def test_numbers_follow_on_without_a_gap():
    seq = Sequence(1)  # a task: create_task logged response.created as #1
    first = seq.number([events.TextDelta(response_id=RID, output_index=0, item_id="m", delta="a"),
                        events.TextDelta(response_id=RID, output_index=0, item_id="m", delta="b")])
    assert [s for s, _, _ in first] == [2, 3] and seq.last == 3
    assert first[0][1] == events.TEXT_DELTA and json.loads(first[1][2])["delta"] == "b"
    assert seq.number([]) == [] and seq.last == 3
    assert events.opening(OBJ) == (1, events.CREATED, '{"response_id":"resp_1","status":"in_progress","response":'
                                                      '{"id":"resp_1","object":"response","status":"in_progress"}}')
    assert Sequence().number([events.ResponseCreated(response_id=RID)])[0][0] == 1  # a direct response's #1


def test_a_stream_closed_by_an_event_nobody_numbered_starts_with_created():
    failed = events.final(RID, "failed", error=PROBLEM, response={**OBJ, "status": "failed"})
    assert [(s, n) for s, n, _ in Sequence().closing([failed])] == [(1, events.CREATED), (2, events.FAILED)]
    assert json.loads(Sequence().closing([failed])[0][2])["response"]["status"] == "in_progress"
    assert [(s, n) for s, n, _ in Sequence(4).closing([failed])] == [(5, events.FAILED)]


@pytest.mark.parametrize("event, text", [
    (events.ResponseCreated(response_id=RID), '{"response_id":"resp_1","status":"in_progress"}'),
    (events.OutputItemAdded(response_id=RID, output_index=0, item=ITEM),
     '{"response_id":"resp_1","output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}'),
    (events.OutputItemDone(response_id=RID, output_index=1, item=ITEM),
     '{"response_id":"resp_1","output_index":1,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}'),
    (events.ContentPartAdded(response_id=RID, output_index=0, item_id="msg_1"),
     '{"response_id":"resp_1","output_index":0,"item_id":"msg_1","content_index":0,'
     '"part":{"type":"output_text","text":"","annotations":[]}}'),
    (events.TextDelta(response_id=RID, output_index=0, item_id="msg_1", delta='é "\n'),
     '{"response_id":"resp_1","output_index":0,"item_id":"msg_1","content_index":0,"delta":"é \\"\\n",'
     '"logprobs":[]}'),
    (events.SummaryDelta(response_id=RID, output_index=0, item_id="rs_1", delta="hm"),
     '{"response_id":"resp_1","output_index":0,"item_id":"rs_1","summary_index":0,"delta":"hm"}'),
    # The extensions OpenAI's API sends (6.3 allows them), with its events' members.
    (events.TextDone(response_id=RID, output_index=0, item_id="msg_1", text="hi"),
     '{"response_id":"resp_1","output_index":0,"item_id":"msg_1","content_index":0,"text":"hi","logprobs":[]}'),
    (events.ContentPartDone(response_id=RID, output_index=0, item_id="msg_1", part=events.text_part("hi")),
     '{"response_id":"resp_1","output_index":0,"item_id":"msg_1","content_index":0,'
     '"part":{"type":"output_text","text":"hi","annotations":[]}}'),
    (events.SummaryPartAdded(response_id=RID, output_index=0, item_id="rs_1"),
     '{"response_id":"resp_1","output_index":0,"item_id":"rs_1","summary_index":0,'
     '"part":{"type":"summary_text","text":""}}'),
    (events.SummaryDone(response_id=RID, output_index=0, item_id="rs_1", text="hm"),
     '{"response_id":"resp_1","output_index":0,"item_id":"rs_1","summary_index":0,"text":"hm"}'),
    (events.SummaryPartDone(response_id=RID, output_index=0, item_id="rs_1", part=events.summary_part("hm")),
     '{"response_id":"resp_1","output_index":0,"item_id":"rs_1","summary_index":0,'
     '"part":{"type":"summary_text","text":"hm"}}'),
    (events.SummaryPartDone(response_id=RID, output_index=0, item_id="rs_1", part=events.summary_part("h"),
                            status="incomplete"),
     '{"response_id":"resp_1","output_index":0,"item_id":"rs_1","summary_index":0,'
     '"part":{"type":"summary_text","text":"h"},"status":"incomplete"}'),
    (events.ArgumentsDelta(response_id=RID, output_index=1, item_id="fc_1", delta='{"a": 1}'),
     '{"response_id":"resp_1","output_index":1,"item_id":"fc_1","delta":"{\\"a\\": 1}"}'),
    (events.ArgumentsDone(response_id=RID, output_index=1, item_id="fc_1", arguments="{}", function_name="f"),
     '{"response_id":"resp_1","output_index":1,"item_id":"fc_1","arguments":"{}","name":"f"}'),
    (events.final(RID, "completed", usage=USAGE, response=OBJ),
     '{"response_id":"resp_1","status":"completed","response":{"id":"resp_1","object":"response","status":'
     '"in_progress"},"usage":{"input_tokens":1,"output_tokens":2,"total_tokens":3}}'),
    (events.final(RID, "completed", usage=None), '{"response_id":"resp_1","status":"completed","usage":null}'),
    (events.final(RID, "incomplete", usage=USAGE, incomplete_details={"reason": "max_output_tokens"}),
     '{"response_id":"resp_1","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},'
     '"usage":{"input_tokens":1,"output_tokens":2,"total_tokens":3}}'),
    (events.final(RID, "failed", error=PROBLEM),
     '{"response_id":"resp_1","status":"failed","error":{"type":"/lmsp/v1/errors#server_restarted",'
     '"code":"server_restarted"}}'),
    (events.final(RID, "cancelled"), '{"response_id":"resp_1","status":"cancelled"}'),
    (events.ErrorEvent(error=PROBLEM),
     '{"error":{"type":"/lmsp/v1/errors#server_restarted","code":"server_restarted"}}'),
    (events.AttemptStarted(response_id=RID, attempt=2), '{"response_id":"resp_1","attempt":2}'),
])
def test_each_event_is_sent_as_before(event, text):
    assert events.encode(event) == text and events.KINDS[event.name] is type(event)
