"""RUN/incidents/<id>/: atomic files, bounded evidence, strict reading of what a stranger may have written."""

import json

import pytest

from trainguard import incidents
from trainguard.incidents import Incident, IncidentError


def _incident(**overrides):
    fields = dict(id=incidents.new_id("hang", 1_700_000_000), kind="hang", detected_at=1_700_000_000.5,
                  detected_by="agent@node-a", culprit={"rank": 1, "node": "node-b"}, confidence=0.9,
                  reasons=["rank 1 never entered allreduce #42"], action="restore")
    fields.update(overrides)
    return Incident(**fields)


def test_a_verdict_and_its_evidence_round_trip(tmp_path):
    incident = _incident(extra={"process_group": "0"})
    incidents.write_incident(tmp_path, incident)
    incidents.write_file(tmp_path, incident.id, "rank-1.stack.txt", "Thread 1 (idle)\n")
    incidents.write_json(tmp_path, incident.id, "node-node-b.json", {"xid": [79]})
    assert incidents.read(tmp_path, incident.id) == incident.to_json()
    assert [p.name for p in incidents.evidence(tmp_path, incident.id)] == ["node-node-b.json", "rank-1.stack.txt"]
    assert list(incidents.scan(tmp_path)) == [(incident.id, incident.to_json(), None)]
    assert not list((tmp_path / "incidents" / incident.id).glob(".*tmp"))


def test_evidence_is_cut_at_its_bound_and_says_so(tmp_path):
    incident = _incident()
    path = incidents.write_file(tmp_path, incident.id, "rank-0.stack.txt", b"x" * 100, max_bytes=10)
    assert path.read_bytes().startswith(b"x" * 10) and b"cut at 10 bytes" in path.read_bytes()


@pytest.mark.parametrize("name", ["../escape.json", "incident.json.bak", "rank-x.fr.json", "a/b.txt"])
def test_names_outside_the_layout_are_refused(tmp_path, name):
    with pytest.raises(IncidentError, match="not one of the layout"):
        incidents.write_file(tmp_path, _incident().id, name, "x")


@pytest.mark.parametrize("bad_id", ["", "../x", ".hidden", "a b"])
def test_ids_outside_the_layout_are_refused(tmp_path, bad_id):
    with pytest.raises(IncidentError, match="incident id"):
        incidents.write_file(tmp_path, bad_id, "incident.json", "{}")


@pytest.mark.parametrize("field,value,message", [
    ("kind", "meltdown", "field 'kind'"),
    ("confidence", 7, "field 'confidence'"),
    ("culprit", {"rank": "zero"}, "culprit.rank"),
    ("reasons", "one", "field 'reasons'"),
])
def test_a_tampered_verdict_is_an_error_naming_file_and_field(tmp_path, field, value, message):
    incident = _incident()
    incidents.write_incident(tmp_path, incident)
    path = tmp_path / "incidents" / incident.id / "incident.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(IncidentError, match=message) as caught:
        incidents.read(tmp_path, incident.id)
    assert str(path) in str(caught.value)
    [(_, verdict, problem)] = incidents.scan(tmp_path)
    assert verdict is None and message in problem


def test_an_incident_still_gathering_evidence_has_no_verdict_yet(tmp_path):
    incidents.write_file(tmp_path, "20261201T000000Z-hang-0000", "node-a.json", "{}")
    assert list(incidents.scan(tmp_path)) == [("20261201T000000Z-hang-0000", None, None)]
