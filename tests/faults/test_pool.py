"""Pooled connections without pre-ping (common/db.py): after a Postgres restart, every connection in an api
process's pool is dead, and not one request may fail for it (the pool drops a connection whose server
closed it at checkout, and all as old with it)."""

import threading

import psutil
import pytest
import requests


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_no_request_fails_on_a_pooled_connection_after_a_postgres_restart(stack, private_servers, mode):
    base = stack.start_api(workers=1, threads=16)
    api = stack.procs[-1]
    secret = stack.token(f"pooled-{mode}")
    statuses: list[int] = []

    def burst(n=16):  # as many requests at once as the pool holds connections, each on its own
        def one():
            with requests.get(base + "/lmsp/v1/tasks", headers={"Authorization": f"Bearer {secret}"},
                              timeout=30) as resp:
                statuses.append(resp.status_code)
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        burst()
        assert set(statuses) == {200} and len(psutil.Process(api.pid).children()) == 1
        postgres = private_servers[0]
        postgres.stop(mode)
        postgres.start()  # pg_ctl -w: ready
        statuses.clear()
        for _ in range(3):
            burst()
        assert statuses == [200] * 48, statuses
    finally:
        stack.stop(api)
