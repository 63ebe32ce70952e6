"""trainguard/signed.py: what a signed control record proves, and what it does not pass for."""

from trainguard import signed

KEY = b"k" * 32


def test_a_signed_record_checks_and_any_change_or_other_key_or_purpose_is_refused():
    record = signed.sign(KEY, "claim/1", {"request_id": "r1", "node": "n1"})
    assert signed.check(KEY, "claim/1", record, {"request_id": "r1"}) is None
    assert signed.check(KEY, "claim/1", {**record, "node": "n2"}, {}) == signed.BAD_SIGNATURE
    assert signed.check(b"x" * 32, "claim/1", record, {}) == signed.BAD_SIGNATURE
    assert signed.check(KEY, "cordon/1", record, {}) == signed.BAD_SIGNATURE     # a claim is no cordon
    assert signed.check(KEY, "claim/1", record, {"request_id": "r2"}) == signed.NOT_BOUND
    assert signed.check(KEY, "claim/1", {"node": "n1"}, {}) == signed.UNSIGNED
    assert signed.check(KEY, "claim/1", ["not", "a", "record"], {}) == signed.UNREADABLE
    assert signed.check(None, "claim/1", record, {}) == signed.NO_KEY


def test_field_order_does_not_matter_and_the_name_tag_needs_the_key():
    a = signed.sign(KEY, "p", {"x": 1, "y": [1, 2]})
    b = signed.sign(KEY, "p", {"y": [1, 2], "x": 1})
    assert a["signature"] == b["signature"]
    assert signed.tag(KEY, "p", "r1/1") != signed.tag(b"o" * 32, "p", "r1/1")
    assert signed.tag(KEY, "p", "r1/1") != signed.tag(KEY, "p", "r1/2")
