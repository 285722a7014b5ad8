"""The web dashboard in headless Chromium (Debian's, driven by Playwright) against the real stack.

The browser reaches the api through a TCP proxy that the test can cut, so "a dropped connection"
is a real one. Screenshots of each page go to artifacts/screenshots/ (git-ignored).
"""

import re
import shutil
import socket
import threading
import uuid
from itertools import pairwise
from pathlib import Path

import pytest

from lmsp.client import output_text
from tests.harness import ROOT, Client, wait_for

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "artifacts" / "screenshots"


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to the api; ``cut()`` ends every open connection, both ways."""

    def __init__(self, target: str):
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                downstream, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [downstream, upstream]
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        with self.lock:
            victims, self.open = self.open, []
        for s in victims:
            try:
                s.shutdown(socket.SHUT_RDWR)  # at once, also for the pipe threads blocked reading it
                s.close()
            except OSError:
                pass
        return len(victims) // 2

    def close(self):
        self.server.close()
        self.cut()


@pytest.fixture(scope="module")
def browser():
    """Chromium through Playwright. Missing pieces fail the test with what to do; nothing is skipped."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `pip install playwright` (it is in the dev extra)")
    if not CHROMIUM.exists():
        found = shutil.which("chromium")
        pytest.fail(f"Chromium is not at {CHROMIUM} ({found=}): `make test` installs it with "
                    "`apt-get install -y chromium`")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def site(api, worker, stack):
    proxy = CuttableProxy(api)
    token = stack.token("dashboard")
    yield proxy, token, Client(api, token)
    proxy.close()


def _events_requests(page) -> list:
    seen = []
    page.on("request", lambda r: seen.append(r) if re.search(r"/tasks/[^/]+/events\?", r.url) else None)
    return seen


def _submit(page, prompt: str, max_tokens: int) -> str:
    page.goto(page.url.split("#")[0] + "#/")
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.press("#prompt", "Control+Enter")  # the keyboard path
    page.wait_for_url(re.compile(r"#/tasks/task_"))
    return page.url.rsplit("/", 1)[1]


def test_dashboard_submit_live_drop_resume_close_cancel(browser, site, model_id):
    proxy, token, same_principal = site
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    streams = _events_requests(page)

    # sign in (the token stays in sessionStorage)
    page.goto(proxy.url + "/")  # the page's CSP forbids eval, so waits poll from Python (wait_for)
    page.wait_for_selector("#signin-page:not([hidden])")
    page.screenshot(path=str(SHOTS / "1-sign-in.png"))
    page.fill("#token", "lmsp_not-a-token")
    page.press("#token", "Enter")
    wait_for(lambda: "unknown" in page.inner_text("#signin-error"), 30, "no sign-in error for a bad token")
    page.fill("#token", token)
    page.press("#token", "Enter")
    page.wait_for_selector("#home-page:not([hidden])")
    page.wait_for_selector(f"#models tbody tr:has-text('{model_id}') td[data-state=ready]")
    # without scope admin the workers panel is per model (worker ids name hosts)
    page.wait_for_selector(f"#workers tbody tr[data-model='{model_id}']")
    assert re.fullmatch(r"[1-9]\d* ready.*", page.locator(f"#workers tbody tr[data-model='{model_id}'] td")
                        .nth(1).inner_text())
    assert page.locator("#workers thead th").all_inner_texts() == ["Model", "Workers", "Loaded on"]
    assert page.evaluate("sessionStorage.getItem('lmsp-token')") == token
    assert page.evaluate("localStorage.length") == 0
    page.screenshot(path=str(SHOTS / "2-home.png"), full_page=True)

    # submit -> live text -> (drop, resume) -> succeeded
    page.select_option("#model", model_id)
    task_id = _submit(page, "Write a long story about a lighthouse keeper.", 200)
    wait_for(lambda: len(page.inner_text("#task-text")) > 40, 180, "no live text")
    assert page.inner_text("#task-state") == "running"  # text is arriving while the task runs
    before = len(page.inner_text("#task-text"))
    assert proxy.cut() >= 1  # the EventSource connection is among those reset
    wait_for(lambda: page.inner_text("#task-stream") == "live" and len(page.inner_text("#task-text")) > before + 20,
             120, "the stream did not resume after the drop")
    page.wait_for_selector("#task-state[data-state=succeeded]", timeout=300_000)
    shown = page.inner_text("#task-text")
    final = same_principal.get(f"/lmsp/v1/tasks/{task_id}").json()
    assert final["status"] == "succeeded"
    assert shown == output_text(final["response"]), "the resumed stream repeated or lost text"
    mine = [r for r in streams if task_id in r.url]
    assert len(mine) >= 2, "the stream was not reopened after the drop"
    reopened = mine[-1]
    resumed_from = reopened.all_headers().get("last-event-id") or re.search(r"after=(\d+)", reopened.url).group(1)
    assert int(resumed_from) > 1
    assert page.inner_text("#task-stream") == "closed"
    assert page.inner_text("#task-tokens").startswith(str(final["response"]["usage"]["output_tokens"]))
    page.screenshot(path=str(SHOTS / "3-task-succeeded.png"), full_page=True)
    # a finished stream stays closed: no reconnect loop (EventSource retries after ~3 s)
    settled = len(streams)
    page.wait_for_timeout(5000)
    assert len(streams) == settled

    # cancel (with the keyboard). The cancel's answer ("cancelling") is held back until the task has
    # ended and the page has shown it from the stream: an answer that comes late must not undo that.
    cancel_id = _submit(page, "Write a very long essay on the history of tea.", 1000)
    wait_for(lambda: len(page.inner_text("#task-text")) > 10, 180, "no live text")
    held = []
    page.route(f"**/tasks/{cancel_id}/cancel", lambda route: held.append((route, route.fetch())))
    page.focus("#cancel")
    page.keyboard.press("Enter")
    page.wait_for_selector("#task-state[data-state=cancelled]", timeout=60_000)
    assert held, "the page showed the end before its cancel was answered"
    route, answer = held[0]
    # The api reads the task again after its abort: a worker quick to stop makes that read "cancelled".
    # The late answer this checks is the one read before the end, so the page gets it as such.
    assert answer.json()["status"] in ("cancelling", "cancelled")
    route.fulfill(response=answer, json={**answer.json(), "status": "cancelling"})
    page.wait_for_timeout(2000)  # the answer is applied at once; the page re-renders every second
    assert page.get_attribute("#task-state", "data-state") == "cancelled"
    assert same_principal.get(f"/lmsp/v1/tasks/{cancel_id}").json()["status"] == "cancelled"
    assert page.inner_text("#task-stream") == "closed"
    page.screenshot(path=str(SHOTS / "4-task-cancelled.png"), full_page=True)

    # the list shows both with state, tokens and duration; one opens to its result
    page.keyboard.press("Escape")
    page.wait_for_selector(f"#tasks tbody tr:has-text('{cancel_id}') td[data-state=cancelled]")
    row = page.locator(f"#tasks tbody tr:has-text('{task_id}')")
    cells = row.locator("td").all_inner_texts()
    assert cells[1] == "succeeded" and cells[2] == str(final["response"]["usage"]["output_tokens"])
    assert re.fullmatch(r"(\d+m )?\d+s", cells[3])
    assert "decode" in row.locator(".timeline").get_attribute("aria-label")  # a bar per task (issue 24)
    page.screenshot(path=str(SHOTS / "5-task-list.png"), full_page=True)
    row.locator("a").click()
    page.wait_for_selector("#task-state[data-state=succeeded]")
    assert page.inner_text("#task-text") == shown
    assert "framework" in page.inner_text("#task-timeline")

    # phone width: nothing wider than the screen
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(proxy.url + "/#/")
    page.wait_for_selector(f"#tasks tbody tr:has-text('{task_id}')")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.screenshot(path=str(SHOTS / "6-phone.png"), full_page=True)
    assert errors == []
    page.close()


def _sign_in(page, url: str, token: str) -> list:
    """Sign ``page`` in with ``token``; the list returned gathers the page's script errors."""
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.fill("#token", token)
    page.press("#token", "Enter")
    page.wait_for_selector("#home-page:not([hidden])")
    return errors


def _list_polls(page) -> list:
    """The task list's requests, as they are sent."""
    seen = []
    page.on("request", lambda r: seen.append(r) if re.search(r"/lmsp/v1/tasks\?", r.url) else None)
    return seen


def _row_state(page, task_id: str) -> str | None:
    row = page.locator(f"#tasks tbody tr[data-id='{task_id}'] td[data-state]")
    return row.get_attribute("data-state") if row.count() else None


def _set_visible(page, visible: bool) -> None:
    """What a hidden tab sees (headless Chromium's pages are always visible)."""
    page.evaluate("""(visible) => {
        Object.defineProperty(document, "visibilityState", {value: visible ? "visible" : "hidden",
                                                            configurable: true});
        document.dispatchEvent(new Event("visibilitychange"));
    }""", visible)


def test_dashboard_live_list_workers_panel_and_timeline(browser, site, api, stack, model_id):
    """Without a click: another client's tasks appear, their states move, the workers panel shows the
    live worker, its model and its rate; a finished task's timeline is drawn; a hidden tab asks nothing."""
    proxy, _, _ = site
    admin = stack.token("watcher", scopes="models:read,tasks:read,tasks:write,tasks:cancel,admin")
    other = Client(api, stack.token("watcher"))  # the same principal, another token
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    polls = _list_polls(page)
    errors = _sign_in(page, proxy.url, admin)

    # scope admin: each worker, its model loaded, its state
    worker = page.locator(f"#workers tbody tr[data-id='test-{model_id}']")
    worker.wait_for()
    assert worker.locator("td").all_inner_texts()[1:3] == [model_id, "ready"]

    def create(text: str, tokens: int) -> str:
        body = {"type": "response", "input": {"model": model_id, "max_output_tokens": tokens, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]}}
        resp = other.post("/lmsp/v1/tasks", body, headers={"Idempotency-Key": uuid.uuid4().hex})
        assert resp.status_code == 202, resp.text
        return resp.json()["id"]

    # a long task from the other client shows up, then runs; the panel shows its rate
    long_id = create("Write a very long essay on the history of tea.", 1000)
    wait_for(lambda: _row_state(page, long_id) is not None, 15, "another client's task did not appear")
    wait_for(lambda: _row_state(page, long_id) == "running", 60, "the task's state did not move to running")
    wait_for(lambda: float(worker.locator("td").nth(4).inner_text().split()[0]) > 0, 15, "no tokens/s shown")
    # Its running count is the worker's next heartbeat's: the rate may already show an earlier task's tokens.
    wait_for(lambda: int(worker.locator("td").nth(3).inner_text()) >= 1, 15, "the running task is not counted")
    short_id = create("Say hello.", 8)
    wait_for(lambda: _row_state(page, short_id) == "succeeded", 60, "a finished task did not show it")
    assert other.post(f"/lmsp/v1/tasks/{long_id}/cancel").status_code == 200
    wait_for(lambda: _row_state(page, long_id) == "cancelled", 15, "the cancellation did not show")

    # the finished task's timeline: a bar of phases, as wide as its wall time
    bar = page.locator(f"#tasks tbody tr[data-id='{short_id}'] .timeline")
    label = bar.get_attribute("aria-label")
    assert "decode" in label and "framework" in label
    widths = [float(w) for w in bar.locator("span").evaluate_all("(s) => s.map((e) => parseFloat(e.style.width))")]
    assert widths and abs(sum(widths) - 100) < 0.5

    # an unchanged list costs a 304 every couple of seconds, and a hidden tab asks nothing
    before = len(polls)
    # Playwright's sync API hands events to Python only inside its calls: the predicate makes one
    wait_for(lambda: page.wait_for_timeout(100) or len(polls) >= before + 3, 20, "the unchanged list is not polled")
    quiet = polls[before:before + 3]
    assert [r.response().status for r in quiet] == [304] * 3
    starts = [r.timing["startTime"] for r in quiet]
    assert all(later - first >= 1900 for first, later in pairwise(starts)), starts
    _set_visible(page, False)
    hidden_at = len(polls)
    unseen_id = create("Say yes.", 4)
    page.wait_for_timeout(4000)
    assert len(polls) == hidden_at and _row_state(page, unseen_id) is None
    _set_visible(page, True)
    wait_for(lambda: _row_state(page, unseen_id) is not None, 10, "the shown tab did not catch up")
    page.screenshot(path=str(SHOTS / "7-live-list-workers.png"), full_page=True)

    # the task view: the timeline's phases named, and who ran it
    page.locator(f"#tasks tbody tr[data-id='{short_id}'] a").click()
    page.wait_for_selector("#task-state[data-state=succeeded]")
    assert any(t.startswith("decode ") for t in page.locator("#task-timeline .legend li").all_inner_texts())
    assert page.inner_text("#task-worker") == f"test-{model_id} (attempt 1)"
    page.screenshot(path=str(SHOTS / "8-task-timeline.png"), full_page=True)
    assert errors == []
    page.close()


def test_a_task_opened_before_the_last_ones_read_answered_is_followed_once(browser, site, model_id):
    """A person opens a task, goes back and submits another before the first one's read has answered:
    the late answer belongs to a page no longer shown, and must not start a second stream for the task
    that is (an EventSource nobody closes reconnects when the stream ends)."""
    proxy, token, same_principal = site
    body = {"type": "response", "input": {"model": model_id, "max_output_tokens": 4, "input": "Say hi."}}
    first = same_principal.post("/lmsp/v1/tasks", body).json()["id"]
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    streams = _events_requests(page)
    errors = _sign_in(page, proxy.url, token)
    page.wait_for_selector(f"#models tbody tr:has-text('{model_id}') td[data-state=ready]")
    held = []
    page.route(f"**/lmsp/v1/tasks/{first}", lambda route: held.append(route))  # its read waits until let go below
    page.goto(proxy.url + f"/#/tasks/{first}")
    for _ in range(100):
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "the first task was not read"
    page.goto(proxy.url + "/#/")
    page.select_option("#model", model_id)
    second = _submit(page, "Write a short story about a fox.", 120)
    wait_for(lambda: len(page.inner_text("#task-text")) > 10, 180, "no live text")
    held[0].continue_()
    page.wait_for_selector("#task-state[data-state=succeeded]", timeout=180_000)
    page.wait_for_timeout(5000)  # a second EventSource would reconnect after the stream's end (~3 s)
    assert len([r for r in streams if f"/tasks/{second}/events" in r.url]) == 1
    assert page.inner_text("#task-title") == second and page.inner_text("#task-stream") == "closed"
    assert errors == []
    page.close()
