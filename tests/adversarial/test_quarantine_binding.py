"""Issue 22, case 8: quarantine is bound to the credential, and a worker whose install reports are
refused has its records refused.

What was seen at commit 97ea5ef: quarantine was per worker id, and forgotten with the worker's
registration, so a quarantined worker carried on under a new registration (one credential holder
used 4 identities); and after a first-registration key swap the coordinator kept accepting a
worker's records although all 302 of its install reports were refused (`wrong_snapshot`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from hostile import Door, HostileWorker


def _quarantine(door: Door, worker: HostileWorker) -> None:
    """Three partial groups pushed: three strikes."""
    lease_id, records = door.honest_lease(worker)
    one_each = list({r["group_id"]: r for r in records}.values())
    for _ in range(door.state.intake.integrity.quarantine_after):
        status, body = worker.push(lease_id, one_each)
        assert status in (403, 422), body
    assert worker.worker_id in door.state.intake.integrity.quarantined


def _register_with(url: str, bearer: str) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/register", data=json.dumps({"name": "again"}).encode(), method="POST"
    )
    req.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_quarantined_worker_registering_again_with_its_credential_stays_quarantined(
    door: Door, mallory: HostileWorker
):
    _quarantine(door, mallory)
    status, body = _register_with(door.url, mallory.secret)
    assert (status, body["error"]) == (403, "quarantined"), body
    assert mallory.lease()[0] == 403
    honest = HostileWorker(door.url, "honest")
    assert _register_with(door.url, honest.secret)[0] == 401, "anyone else's credential: unchanged"


def test_the_quarantine_outlives_the_forgotten_registration(door: Door, mallory: HostileWorker):
    """A quarantined worker that goes silent is marked lost, then purged (its registration
    forgotten); its credential is still refused as quarantined, not as unknown (which would tell
    it to register again)."""
    _quarantine(door, mallory)
    state = door.state
    door.clock.now += max(state.registry.heartbeat_timeout, state.purge_after) + 1.0
    state.expire()
    assert mallory.worker_id not in state.registry.workers, "purged"
    for status, body in (
        mallory.lease(),
        mallory.call("POST", "/v1/heartbeat", {"worker_id": mallory.worker_id, "version": 0}),
    ):
        assert (status, body["error"]) == (403, "quarantined"), body
    door.learner_trains()


def test_no_records_from_a_worker_whose_install_report_is_refused(door: Door, mallory: HostileWorker):
    """The worker reports installing bytes that are not the published version 0 (its pinned key
    was swapped, or it lies): a strike, and its records of version 0 are refused; three such
    reports quarantine it."""
    intake = door.state.intake
    report = {"worker_id": mallory.worker_id, "version": 0, "sha256": "ab" * 32}
    status, body = mallory.call("POST", "/v1/broadcast/installed", report)
    assert (status, body["error"]) == (422, "wrong_snapshot"), body
    assert intake.integrity.strikes[mallory.worker_id] == 1
    lease_id, records = door.honest_lease(mallory)
    before = door.snapshot()
    status, body = mallory.push(lease_id, records)
    assert (status, body["error"]) == (422, "wrong_snapshot"), body
    after = door.snapshot()
    assert after["seen"] == before["seen"] and after["buffer"] == before["buffer"], "nothing stored"
    mallory.call("POST", "/v1/broadcast/installed", report)
    assert mallory.worker_id in intake.integrity.quarantined
    assert mallory.push(lease_id, records)[0] == 403
    door.learner_trains()
