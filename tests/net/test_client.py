"""`CoordinatorClient` over real loopback HTTP (port 0): the coordinator's refusals arrive as typed
exceptions; the one retry policy retries 5xx answers and refused connections until they succeed,
never retries a 4xx, and gives up within its attempts and its time. Each test is bounded."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from support import make_state

from echo2.coordinator.server import Coordinator
from echo2.records import Trajectory
from echo2.wire.client import CoordinatorClient, RetryPolicy, ServerError, Unreachable, refusal
from echo2.wire.errors import (
    Forbidden,
    Invalid,
    LeaseExpired,
    NoSnapshot,
    NotFound,
    Refused,
    Released,
    Stale,
    TooLarge,
    Unauthorized,
    UnknownWorker,
)
from echo2.wire.protocol import (
    HeartbeatRequest,
    LeaseRequest,
    PushRequest,
    RegisterRequest,
    ReturnRequest,
    RouteRequest,
)

TOKEN = "client-token"
FAST = RetryPolicy(max_attempts=5, give_up_after=10.0, initial_delay=0.01, max_delay=0.05)


def bounded(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def coord():
    state = make_state(heartbeat_timeout=30.0)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    yield server, state
    server.stop()


def record(group_id: str, version: int = 0) -> Trajectory:
    return Trajectory(
        record_id=f"r-{group_id}-{version}",
        group_id=group_id,
        prompt_ids=(1, 2),
        response_ids=(3,),
        behaviour_logprobs=(-0.5,),
        loss_mask=(1,),
        reward=1.0,
        version=version,
    )


# ---------------------------------------------------------------------------- typed refusals
def test_the_coordinators_refusals_arrive_typed(coord):
    server, state = coord

    async def scenario():
        async with await CoordinatorClient.create(server.url, "wrong", retry=FAST) as bad:
            with pytest.raises(Unauthorized) as e:
                await bad.register(RegisterRequest(name="w"))
            assert e.value.status == 401 and e.value.reason == "unauthorized"
        async with await CoordinatorClient.create(server.url, TOKEN, retry=FAST) as c:
            reg = await c.register(RegisterRequest(name="w"))
            wid = reg.worker_id
            assert reg.public_key == state.publisher.public_key and reg.published_version == -1
            with pytest.raises(Forbidden) as e:  # our credential is not nobody's
                await c.heartbeat(HeartbeatRequest(worker_id="nobody", version=-1))
            assert (e.value.status, e.value.reason) == (403, "forbidden") and e.value.detail
            mine, c.credential = c.credential, "nobody.secret"
            with pytest.raises(UnknownWorker) as e:  # a credential of a worker not registered here
                await c.heartbeat(HeartbeatRequest(worker_id="nobody", version=-1))
            assert (e.value.status, e.value.reason) == (404, "unknown_worker") and e.value.detail
            c.credential = mine
            with pytest.raises(Invalid) as e:  # 422 future_version
                await c.heartbeat(HeartbeatRequest(worker_id=wid, version=5))
            assert (e.value.status, e.value.reason) == (422, "future_version")
            beat = await c.heartbeat(HeartbeatRequest(worker_id=wid, version=-1))
            assert (beat.published_version, beat.epoch) == (-1, state.epoch)
            assert await c.lease(LeaseRequest(worker_id=wid, version=-1, max_groups=1)) is None  # 204
            with pytest.raises(NoSnapshot):
                await c.manifest(0)
            state.publisher.publish(0, b"v0", keep=2)
            assert (await c.manifest(0))["version"] == 0
            assert await c.published(after=-1, wait=0) == 0
            route = await c.route(RouteRequest(worker_id=wid, version=0))
            assert (route.parent_id, route.url) == (None, None)
            with pytest.raises(NoSnapshot):
                await c.route(RouteRequest(worker_id=wid, version=7))
            lease = await c.lease(LeaseRequest(worker_id=wid, version=0, max_groups=1))
            assert lease is not None and lease.indices == [0]
            with pytest.raises(LeaseExpired) as e:
                await c.push(PushRequest(worker_id=wid, lease_id="not-mine", records=[record("g0")]))
            assert (e.value.status, e.value.reason) == (409, "lease_expired")
            with pytest.raises(Invalid) as e:
                await c.push(PushRequest(worker_id=wid, lease_id=lease.lease_id, records=[record("g9")]))
            assert e.value.reason == "wrong_group"
            state.publisher.publish(1, b"v1", keep=2)
            state.publisher.publish(2, b"v2", keep=2)
            state.intake.set_learner_version(2)  # v - S = 1 > 0: version-0 records are stale
            with pytest.raises(Stale) as e:
                await c.push(PushRequest(worker_id=wid, lease_id=lease.lease_id, records=[record("g0")]))
            assert (e.value.status, e.value.reason) == (409, "stale")
            await c.return_lease(ReturnRequest(worker_id=wid, lease_id=lease.lease_id))
            assert c.retries == 0, "no refusal is retried"

    bounded(scenario())


def test_refusal_table():
    """Reasons the coordinator sends that the fixture does not provoke: released (410), a body
    that is not JSON of the usual shape, 5xx."""
    assert type(refusal(410, {"error": "released", "detail": "stop"})) is Released
    assert type(refusal(413, {"error": "too_large", "detail": ""})) is TooLarge
    assert type(refusal(404, {"error": "not_found", "detail": ""})) is NotFound
    assert type(refusal(503, {"error": "timeout", "detail": ""})) is ServerError
    assert type(refusal(500, None)) is ServerError
    e = refusal(418, "teapot")
    assert type(e) is Refused and (e.status, e.reason, e.body) == (418, "", "teapot")


# ---------------------------------------------------------------------------- the retry policy
class Flaky:
    """A stand-in coordinator that answers `fail` times with `status`, then 200 `{"version": 3}`."""

    def __init__(self, *, fail: int, status: int = 503, reason: str = "timeout") -> None:
        self.fail, self.status, self.reason = fail, status, reason
        self.hits = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hits <= self.fail:
            return web.json_response({"error": self.reason, "detail": "injected"}, status=self.status)
        return web.json_response({"version": 3})

    async def start(self, sock: socket.socket | None = None) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_get("/v1/published", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        if sock is None:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
        else:
            await web.SockSite(runner, sock).start()
            port = sock.getsockname()[1]
        return runner, f"http://127.0.0.1:{port}"


def test_5xx_is_retried_until_it_succeeds():
    async def scenario():
        flaky = Flaky(fail=3)
        runner, url = await flaky.start()
        try:
            async with await CoordinatorClient.create(url, TOKEN, retry=FAST) as c:
                assert await c.published(wait=0) == 3
                assert (flaky.hits, c.retries) == (4, 3)
        finally:
            await runner.cleanup()

    bounded(scenario())


@pytest.mark.parametrize("status,reason", [(404, "unknown_worker"), (409, "stale"), (422, "malformed")])
def test_4xx_is_never_retried(status, reason):
    async def scenario():
        flaky = Flaky(fail=1, status=status, reason=reason)
        runner, url = await flaky.start()
        try:
            async with await CoordinatorClient.create(url, TOKEN, retry=FAST) as c:
                with pytest.raises(Refused) as e:
                    await c.published(wait=0)
                assert (e.value.status, e.value.reason) == (status, reason)
                assert (flaky.hits, c.retries) == (1, 0)
        finally:
            await runner.cleanup()

    bounded(scenario())


def test_attempts_and_time_are_bounded():
    async def scenario():
        flaky = Flaky(fail=10**6)
        runner, url = await flaky.start()
        try:
            async with await CoordinatorClient.create(url, TOKEN, retry=FAST) as c:
                with pytest.raises(Unreachable) as e:
                    await c.published(wait=0)
                assert isinstance(e.value.__cause__, ServerError) and isinstance(e.value, ConnectionError)
                assert flaky.hits == FAST.max_attempts
            slow = RetryPolicy(max_attempts=10**6, give_up_after=0.5, initial_delay=0.05, max_delay=0.05)
            async with await CoordinatorClient.create(url, TOKEN, retry=slow) as c:
                loop = asyncio.get_running_loop()
                t0, hits0 = loop.time(), flaky.hits
                with pytest.raises(Unreachable):
                    await c.published(wait=0)
                assert loop.time() - t0 < 5.0 and 2 <= flaky.hits - hits0 < 100
            stop = asyncio.Event()
            stop.set()
            async with await CoordinatorClient.create(url, TOKEN, retry=FAST, stop=stop) as c:
                hits0 = flaky.hits
                with pytest.raises(Unreachable):  # stopping: no retry at all
                    await c.published(wait=0)
                assert flaky.hits - hits0 == 1
        finally:
            await runner.cleanup()

    bounded(scenario())


def test_a_refused_connection_is_retried_until_the_server_listens():
    """The port is bound but not listening (connections are refused) until the first retry is
    logged; then a server listens on that very socket and the call succeeds."""

    async def scenario():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        policy = RetryPolicy(max_attempts=50, give_up_after=20.0, initial_delay=0.05, max_delay=0.2)
        async with await CoordinatorClient.create(url, TOKEN, retry=policy) as c:
            call = asyncio.create_task(c.published(wait=0))
            while c.retries == 0:
                assert not call.done(), call
                await asyncio.sleep(0.01)
            runner, _ = await Flaky(fail=0).start(sock)
            try:
                assert await call == 3
            finally:
                await runner.cleanup()

    bounded(scenario())


def test_close_is_idempotent():
    async def scenario():
        c = await CoordinatorClient.create("http://127.0.0.1:1", TOKEN)
        await c.close()
        await c.close()
        assert c.session.closed

    bounded(scenario())


def test_the_policy_backoff_doubles_up_to_its_cap():
    """The one backoff: what tenacity waits between calls and what the broadcast client waits
    before asking the learner for a stream again."""
    from echo2.wire.client import RetryPolicy

    policy = RetryPolicy(initial_delay=0.2, max_delay=5.0)
    assert [policy.delay(k) for k in range(6)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
