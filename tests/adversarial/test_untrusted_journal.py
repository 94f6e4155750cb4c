"""Issue 22, round 2 of untrusted workers, C: the journal a resumed learner trusts (its key private,
every line signed; a tampered, appended, corrupted or deleted line skipped or reported; a replayed
batch through the door again). Each test fails on commit 97ea5ef."""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------------------- C: the journal on resume
def _rec(gid: str, rid: str, reward: float = 1.0):
    from echo2.records import Trajectory

    return Trajectory(
        group_id=gid,
        prompt_ids=(5, 6),
        response_ids=(7, 8),
        behaviour_logprobs=(-0.1, -0.2),
        loss_mask=(1, 1),
        reward=reward,
        version=0,
        record_id=rid,
    )


def _ingestion():
    from echo2.coordinator.leases import Leases, Limits, Work
    from echo2.data.buffer import ReplayBuffer

    return Leases(
        Work(
            buffer=ReplayBuffer(staleness=1, group_size=2),
            limits=Limits(
                vocab_size=64, max_prompt_tokens=16, max_new_tokens=8, group_size=2, reward_range=(0.0, 1.0)
            ),
            group_id_of=lambda i: f"g{i}",
        ),
        lease_timeout=30.0,
    )


@pytest.fixture
def journalled(tmp_path):
    """A journal of three accepted batches (groups g0, g1, g2) after a checkpoint at byte `offset`."""
    from echo2.coordinator import journal

    path = tmp_path / journal.NAME
    log = journal.Journal(path, epoch="e1")
    offset = log.offset()
    for i in range(3):
        log.accepted([_rec(f"g{i}", f"r{i}a"), _rec(f"g{i}", f"r{i}b")], {f"g{i}": i})
    log.close()
    return path, offset


def _resume(path, offset, referee=None) -> set[str]:
    from echo2.coordinator import journal

    ingestion = _ingestion()
    journal.replay(ingestion, journal.accepted_since(path, offset), referee=referee)
    return set(ingestion.buffer._seen)


def _lines(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_the_journal_key_is_private_and_every_line_is_signed_and_numbered(journalled):
    import json
    import stat

    path, offset = journalled
    key = path.with_name("journal.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    entries = [json.loads(line) for line in _lines(path)]
    assert [e["seq"] for e in entries] == [0, 1, 2, 3] and all(len(e["mac"]) == 64 for e in entries)
    assert _resume(path, offset) == {f"r{i}{k}" for i in range(3) for k in "ab"}


def test_a_tampered_line_is_skipped_with_a_warning_naming_it(journalled, caplog):
    path, offset = journalled
    lines = _lines(path)
    lines[2] = lines[2].replace(b'"reward":1.0', b'"reward":0.0', 1)  # a forged reward in batch g1
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING"):
        trained = _resume(path, offset)
    assert trained == {"r0a", "r0b", "r2a", "r2b"}
    assert "line 3 skipped: bad MAC" in caplog.text


def test_an_appended_line_the_learner_did_not_write_is_never_trained(journalled, caplog):
    """Four never-pushed records (a prompt no lease handed out, a forged reward), as issue 22 saw."""
    import json

    path, offset = journalled
    forged = {"accepted": [_rec("g9", f"x{k}").to_dict() for k in range(4)], "prompts": {"g9": 9}}
    with path.open("ab") as f:
        compact = {"separators": (",", ":")}  # the journal's own layout, a made-up MAC
        f.write(json.dumps({**forged, "seq": 4, "mac": "0" * 64}, **compact).encode() + b"\n")
        f.write(json.dumps({**forged, "seq": 5}, **compact).encode() + b"\n")
    with caplog.at_level("WARNING"):
        trained = _resume(path, offset)
    assert not {r for r in trained if r.startswith("x")}
    assert "line 5 skipped: bad MAC" in caplog.text and "line 6 skipped: no MAC" in caplog.text


def test_a_corrupted_line_does_not_stop_the_resume(journalled, caplog):
    path, offset = journalled
    lines = _lines(path)
    lines[1] = b"\x00\xff garbage {{{\n"
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING"):
        trained = _resume(path, offset)
    assert trained == {"r1a", "r1b", "r2a", "r2b"} and "line 2 skipped" in caplog.text


def test_a_deleted_line_is_reported_as_a_gap(journalled, caplog):
    path, offset = journalled
    lines = _lines(path)
    del lines[2]
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING"):
        trained = _resume(path, offset)
    assert trained == {"r0a", "r0b", "r2a", "r2b"}
    assert "line 3: 1 lines missing before it (seq 3, expected 2)" in caplog.text


def test_a_truncated_or_deleted_journal_is_reported(journalled, caplog):
    path, _ = journalled
    size = path.stat().st_size
    with caplog.at_level("WARNING"):
        assert _resume(path, size + 10) == set()
        assert "is truncated" in caplog.text
        path.unlink()
        assert _resume(path, size) == set()
        assert "is gone" in caplog.text


def test_a_replayed_batch_goes_through_the_door_again(tmp_path, caplog):
    """A line the learner signed, holding what the door now refuses (a reward outside the task's
    range, a control character in metadata, a referee's refusal): skipped whole, its prompt regenerated."""
    import dataclasses

    from echo2.coordinator import journal
    from echo2.wire.validate import Problem

    path = tmp_path / journal.NAME
    log = journal.Journal(path, epoch="e1")
    log.accepted([_rec("g0", "a", reward=5.0), _rec("g0", "b")], {"g0": 0})
    odd = dataclasses.replace(_rec("g1", "c"), metadata={"note": "\x1b[2J"})
    log._write({"accepted": [odd, _rec("g1", "d")], "prompts": {"g1": 1}})
    log.accepted([_rec("g2", "e"), _rec("g2", "f")], {"g2": 2})
    log.accepted([_rec("g3", "g"), _rec("g3", "h")], {"g3": 3})
    log.close()

    class Referee:
        def check(self, record, index):
            return Problem(reason="reward_mismatch", detail="forged") if index == 2 else None

    ingestion = _ingestion()
    with caplog.at_level("WARNING"):
        journal.replay(ingestion, journal.accepted_since(path, 0), referee=Referee())
    assert set(ingestion.buffer._seen) == {"g", "h"}
    assert (
        "reward_out_of_range" in caplog.text
        and "control character" in caplog.text
        and "forged" in caplog.text
    )
    assert sorted(ingestion.reissue) == [0, 1, 2], "the refused batches' prompts are generated again"
