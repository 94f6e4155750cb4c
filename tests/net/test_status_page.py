"""The coordinator's status page (GET /ui) in a real headless Chromium, its sign-in (token once,
then an HttpOnly cookie), and GET /metrics in the Prometheus text format."""

from __future__ import annotations

import html.parser
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import FakeClock, make_state

from echo2.coordinator.server import Coordinator
from echo2.coordinator.status_page import COOKIE, session_value

TOKEN = "page-token-123"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LEARNER = {
    "t_train": 1.25,
    "t_bcast": 0.5,
    "bubble_ratio": 0.125,
    "learner_idle_s": 3.0,
    "staleness_histogram": {"0": 8, "1": 3},
}


@pytest.fixture
def coord():
    clock = FakeClock()
    state = make_state(clock)
    server = Coordinator(
        state, token=TOKEN, run_info={}, heartbeat_interval=1.0, status_extra=lambda: dict(LEARNER)
    )
    server.start()
    yield server, state, clock
    server.stop()


def post(server, path, body, credential: str = TOKEN):
    import json

    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {credential}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def populate(server, state) -> None:
    """Two workers (one named like markup), a snapshot, a lease, one accepted and one refused push."""
    reply = post(server, "/v1/register", {"name": "alpha", "price_per_hour": 0.35})
    alpha, own = reply["worker_id"], reply["credential"]  # a worker's calls carry its own credential
    post(server, "/v1/register", {"name": "<b>beta</b>", "price_per_hour": 3.06})
    state.publisher.publish(0, b"weights-v0", keep=2)
    lease = post(server, "/v1/lease", {"worker_id": alpha, "version": 0, "max_groups": 1}, own)
    gid = f"g{lease['indices'][0]}"
    good = [
        {
            "record_id": f"r{i}",
            "group_id": gid,
            "prompt_ids": [1, 2],
            "response_ids": [3, 4],
            "behaviour_logprobs": [-0.1, -0.1],
            "loss_mask": [1, 1],
            "reward": float(i),
            "version": 0,
        }
        for i in range(2)
    ]
    post(
        server, "/v1/trajectories", {"worker_id": alpha, "lease_id": lease["lease_id"], "records": good}, own
    )
    bad = [dict(r, record_id=f"x{r['record_id']}", response_ids=[3]) for r in good]  # lengths disagree
    with pytest.raises(urllib.error.HTTPError):
        post(
            server,
            "/v1/trajectories",
            {"worker_id": alpha, "lease_id": lease["lease_id"], "records": bad},
            own,
        )


class _Text(html.parser.HTMLParser):
    """The page's tables as lists of cell texts, by table id; the cards by data-key."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.cards: dict[str, str] = {}
        self._table = self._card = None
        self._cell: list[str] | None = None
        self._in_value = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag == "td" and self._table:
            self._cell = []
        elif tag == "div" and "data-key" in a:
            self._card = a["data-key"]
        elif tag == "div" and a.get("class") == "v" and self._card:
            self._in_value = True

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "div" and self._in_value:
            self._in_value = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_value:
            self.cards[self._card] = self.cards.get(self._card, "") + data


def rows(page: _Text, table: str) -> list[list[str]]:
    return [r for r in page.tables[table] if r]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it as root)")
def test_the_page_shows_the_run_in_headless_chromium(coord, tmp_path):
    server, state, _ = coord
    populate(server, state)
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",  # let the page's fetch of /status complete
            "--dump-dom",
            f"{server.url}/ui?token={TOKEN}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    page = _Text()
    page.feed(out.stdout)
    assert "echo2 run status" in out.stdout, "signed in through the token once, then the cookie"
    workers = {r[0]: r for r in rows(page, "workers")}
    assert set(workers) == {"alpha", "<b>beta</b>"}, "names shown as text, never as markup"
    assert workers["alpha"][1] == "active" and workers["alpha"][4] == "0.350"
    assert page.cards["bubble_ratio"] == "0.125" and page.cards["t_train"] == "1.25 s"
    assert page.cards["accepted"] == "2" and page.cards["published_version"] == "0"
    assert rows(page, "staleness") == [["0", "8", ""], ["1", "3", ""]]
    assert ["malformed", "ingestion", "2"] in rows(page, "rejected")
    assert rows(page, "buffer") == [["0", "2"]]


def fetch(url: str, *, data: bytes | None = None, headers: dict | None = None):
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_sign_in_sets_an_httponly_cookie_that_is_not_the_token(coord):
    server, _, _ = coord
    status, _, body = fetch(server.url + "/ui")
    assert status == 401 and "<form" in body
    status, _, body = fetch(server.url + "/ui?token=wrong")
    assert status == 401 and "Wrong token" in body
    status, headers, _ = fetch(server.url + "/ui", data=f"token={TOKEN}".encode())
    assert status == 302 and headers["Location"] == "/ui"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    jar = {"Cookie": f"{COOKIE}={session_value(TOKEN)}"}
    assert fetch(server.url + "/ui", headers=jar)[0] == 200
    status, _, body = fetch(server.url + "/status", headers=jar)
    assert status == 200 and '"learner_version"' in body
    assert fetch(server.url + "/status", headers={"Cookie": f"{COOKIE}=forged"})[0] == 401
    status, _, _ = fetch(server.url + "/v1/register", data=b'{"name": "w"}', headers=jar)
    assert status == 401, "the cookie reads the status, it does not make a worker"


def test_metrics_in_prometheus_text_format(coord):
    server, state, _ = coord
    populate(server, state)
    assert fetch(server.url + "/metrics")[0] == 401
    status, headers, body = fetch(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("echo2_bubble_ratio", ())] == 0.125
    assert samples[("echo2_records_accepted_total", ())] == 2
    assert samples[("echo2_records_rejected_total", (("reason", "malformed"), ("where", "ingestion")))] == 2
    assert samples[("echo2_workers", (("state", "active"),))] == 2
    assert samples[("echo2_consumed_records_total", (("staleness", "1"),))] == 3
