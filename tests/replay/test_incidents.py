"""The incident library: every tests/incidents/<name>/ log replays to its expect.yml, with the project's
own alert rules (alerts/) evaluated by promtool. See tests/incidents/README.md for where each log came from."""

from pathlib import Path

import pytest

from tests.servers import require_binary
from trainguard.cli import main
from trainguard.replay import expect, source

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "tests" / "incidents"
RULES = ROOT / "alerts"
INCIDENTS = sorted(path.parent.name for path in LIBRARY.glob("*/expect.yml"))
REQUIRED = {"loss-spike", "nan", "gradient-explosion", "hang", "cost-warn", "cost-throttle", "cost-stop",
            "overheating", "io-stall", "memory-fragmentation", "healthy-long"}


def test_the_library_has_every_incident():
    assert REQUIRED <= set(INCIDENTS)


@pytest.mark.parametrize("name", INCIDENTS)
def test_incident_replays_to_its_expectation(name, capsys):
    require_binary("promtool")
    folder = LIBRARY / name
    code = main(["replay", str(folder), "--rules", str(RULES), "--expect", str(folder / "expect.yml")])
    captured = capsys.readouterr()
    assert code == 0, f"{name}:\n{captured.err}\n{captured.out}"


@pytest.mark.parametrize("name", INCIDENTS)
def test_incident_logs_are_clean_and_compressed(name):
    folder = LIBRARY / name
    stream = source.Stream([folder])
    records = sum(1 for _ in stream)
    assert records > 0 and stream.malformed == 0
    assert all(path.suffix in (".gz", ".zst") for path in stream.files)
    expected = expect.load(folder / "expect.yml")
    assert expected.none or expected.entries
