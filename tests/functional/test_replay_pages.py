"""A long log's replay on Postgres (issue 38, item 4): its pages are read in the primary key's order, so a
page reads what it returns, however much of the log lies after it (no bitmap scan and sort of the rest of
the log for each page: a replay's cost would grow with the square of its length)."""

import json
import time

import psycopg
import pytest

from common import eventlog
from common.db import make_engine, session_factory
from tests.bench.fleet_load import dsn

RID = "resp_replaypages00000000000"


@pytest.fixture(scope="module")
def sessions(pg_url):
    with psycopg.connect(dsn(pg_url)) as conn:
        conn.execute("INSERT INTO principals (id, created_at) VALUES ('pages', 0) ON CONFLICT DO NOTHING")
        conn.execute("INSERT INTO responses (id, principal_id, model, request, status, stored, created_at, "
                     "updated_at) VALUES (%s, 'pages', 'm', '{}', 'completed', true, 0, 0)", (RID,))
        data = json.dumps({"delta": "é ✓ 100%"}, ensure_ascii=False)
        with conn.cursor().copy("COPY events (response_id, seq, name, data, created_at) FROM STDIN") as copy:
            for seq in range(1, 12_002):
                copy.write_row((RID, seq, "response.output_text.delta", data, time.time()))
    engine = make_engine(pg_url)
    yield session_factory(engine)
    engine.dispose()


def test_a_long_log_is_read_in_order_page_by_page(sessions):
    after, seen = 0, 0
    with sessions() as session:
        while page := eventlog.read(session, RID, after, limit=2000):
            assert [seq for seq, _, _ in page] == list(range(after + 1, after + len(page) + 1))
            assert page[0][2] == json.dumps({"delta": "é ✓ 100%"}, ensure_ascii=False)
            after, seen = page[-1][0], seen + len(page)
        # Fresh rows, no statistics yet: left to itself the planner reads all 12,001 for each page and
        # sorts them (a bitmap scan); in the primary key's order a page reads what it returns.
        plan = "\n".join(row[0] for row in eventlog._in_order(
            session.connection(), "EXPLAIN " + eventlog._PAGE.format(mark="%s"), (RID, 0, 2000)))
    assert seen == 12_001
    assert "Index Scan" in plan and "Sort" not in plan and "Bitmap" not in plan, plan
