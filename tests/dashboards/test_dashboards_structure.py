"""The generated dashboards: checked in as generated, well formed, stable, and their queries parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
import yaml

from tests.dashboards.promql import substitute, used_variables
from tests.servers import require_binary
from trainguard.dashboards import build
from trainguard.dashboards.cli import payload, read_token, PushError
from trainguard.policy import AlertPolicy, CostPolicy, Policy

DASHBOARDS = Path(build.__file__).resolve().parent
PROF_CSV = Path("/work/shared/real-logs/names/dcgm-exporter_dcp-metrics-included.csv")
TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
UIDS = {"training.json": "trainguard-training", "gpu-node.json": "trainguard-gpu-node",
        "cost-goodput.json": "trainguard-cost-goodput", "comms-io.json": "trainguard-comms-io",
        "alerts-actions.json": "trainguard-alerts-actions"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in build.render().items()}


def test_checked_in_files_match_the_generator():
    for name, text in build.render().items():
        on_disk = (DASHBOARDS / name).read_text()
        assert on_disk == text, f"dashboards/{name} drifted: run `python -m trainguard.dashboards.build`"
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(build.BOARDS)


def test_uids_are_stable_and_unique(rendered):
    assert {name: board["uid"] for name, board in rendered.items()} == UIDS


def test_panel_ids_are_unique_and_grid_positions_valid(rendered):
    for name, board in rendered.items():
        panels = board["panels"]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), name
        boxes = []
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0, (name, panel["title"])
            assert pos["x"] + pos["w"] <= 24, (name, panel["title"])
            boxes.append((pos["x"], pos["y"], pos["x"] + pos["w"], pos["y"] + pos["h"], panel["title"]))
        for a, b in combinations(boxes, 2):
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, f"{name}: {a[4]!r} overlaps {b[4]!r}"


def test_every_variable_used_is_defined_before_use(rendered):
    for name, board in rendered.items():
        defined = []
        for variable in board["templating"]["list"]:
            assert used_variables(json.dumps(variable.get("query", ""))) <= set(defined), (name, variable["name"])
            defined.append(variable["name"])
        assert defined[0] == "datasource" and "job" in defined, name
        used = used_variables(json.dumps(board["panels"])) | used_variables(json.dumps(board["annotations"]))
        assert used <= set(defined), f"{name}: undefined {used - set(defined)}"
        assert set(defined) - {"datasource"} <= used, f"{name}: defined but unused {set(defined) - used}"


def test_every_panel_queries_prometheus_through_the_datasource_variable(rendered):
    for name, board in rendered.items():
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), (name, panel["title"])
            assert panel["fieldConfig"]["defaults"]["unit"], (name, panel["title"])


def test_only_when_queries_say_why():
    queries = list(build.queries())
    assert len(queries) > 60
    flagged = [(uid, title, query) for uid, title, query in queries if query.only_when]
    assert all(len(query.only_when) > 20 for _, _, query in flagged)
    assert len(flagged) < len(queries) / 5       # an escape hatch, not the rule


def test_thresholds_follow_the_policy():
    policy = Policy(alerts=AlertPolicy(gpu_temp_c=77.0, disk_await_ms=25.0),
                    cost=CostPolicy(budget_per_1k_steps=200.0))

    def steps(board: dict, title: str) -> list[float]:
        panel = next(p for p in board["panels"] if p["title"] == title)
        return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]]

    custom = {name: json.loads(text) for name, text in build.render(policy).items()}
    assert steps(custom["gpu-node.json"], "GPU temperature") == [72.0, 77.0]
    assert steps(custom["comms-io.json"], "Disk await") == [0.025]
    assert steps(custom["cost-goodput.json"], "Cost per 1000 steps") == [260.0, 320.0, 400.0]
    default = {name: json.loads(text) for name, text in build.render().items()}
    assert steps(default["gpu-node.json"], "GPU temperature") == [80.0, 85.0]


def test_every_query_parses_with_promtool(tmp_path):
    promtool = require_binary("promtool")
    values = {"job": ".*", "run_id": ".*", "hostname": ".*", "gpu": ".*", "datasource": "x"}
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(query.expr, values)}
             for i, (_, _, query) in enumerate(build.queries())]
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_provisioning_files(rendered):
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards.yml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load((DASHBOARDS / "provisioning" / "datasource.example.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"


def test_render_cli_writes_the_same_files(tmp_path):
    done = subprocess.run(TRAINGUARD + ["dashboards", "render", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in build.BOARDS:
        assert (tmp_path / name).read_text() == (DASHBOARDS / name).read_text()


def test_push_payload_overwrites_by_uid_into_the_folder(rendered):
    body = payload(rendered["training.json"], "trainguard")
    assert body["overwrite"] is True and body["folderUid"] == "trainguard"
    assert body["dashboard"]["uid"] == "trainguard-training" and body["dashboard"]["id"] is None


def test_push_refuses_unsafe_or_empty_token_files_and_names_an_unreachable_grafana(tmp_path):
    token = tmp_path / "token"
    token.write_text("glsa_secret\n")
    os.chmod(token, 0o644)
    with pytest.raises(PushError, match="chmod 600"):
        read_token(token)
    os.chmod(token, 0o600)
    assert read_token(token) == "glsa_secret"
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    os.chmod(empty, 0o600)
    with pytest.raises(PushError, match="empty"):
        read_token(empty)
    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(TRAINGUARD + ["dashboards", "push", "--url", url, "--token-file", str(token)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{url}: cannot reach Grafana" in done.stderr


def test_legends_are_tables_of_mean_last_and_max(rendered):
    for name, board in rendered.items():
        for panel in board["panels"]:
            if panel["type"] == "timeseries":
                legend = panel["options"]["legend"]
                assert legend["displayMode"] == "table", (name, panel["title"])
                assert legend["calcs"] == ["mean", "lastNotNull", "max"], (name, panel["title"])


def test_every_board_links_to_the_others_keeping_time_and_variables(rendered):
    for name, board in rendered.items():
        [link] = board["links"]
        assert link["type"] == "dashboards" and link["tags"] == ["trainguard"], name
        assert link["includeVars"] and link["keepTime"], name
        assert "trainguard" in board["tags"], name       # the tag the links follow: all five are reached


def test_sm_and_tensor_activity_panels_read_dcgm_profiling_fields(rendered):
    panels = {p["title"]: p for p in rendered["gpu-node.json"]["panels"]}
    assert panels["SM activity"]["targets"][0]["expr"].startswith("DCGM_FI_PROF_SM_ACTIVE{")
    assert panels["Tensor core activity"]["targets"][0]["expr"].startswith("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{")
    names = {line.split(",")[0].strip().lstrip("# ") for line in PROF_CSV.read_text().splitlines()
             if line.strip().lstrip("# ").startswith("DCGM_FI_PROF")} if PROF_CSV.exists() else set()
    if names:      # dcgm-exporter spells them so (its counters CSV)
        assert {"DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"} <= names


def test_gpu_panels_use_dcgm_exporters_label_names(rendered):
    board = rendered["gpu-node.json"]
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    assert 'Hostname=~"$hostname"' in exprs and "hostname=~" not in exprs
    [host] = [v for v in board["templating"]["list"] if v["name"] == "hostname"]
    assert host["query"].endswith(", Hostname)")


def test_the_mixin_sets_the_default_datasource(tmp_path):
    mixin_file = tmp_path / "mixin.yaml"
    mixin_file.write_text("datasource: Thanos\n")
    done = subprocess.run(TRAINGUARD + ["dashboards", "render", "--out", str(tmp_path / "out"), "--mixin",
                                        str(mixin_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    board = json.loads((tmp_path / "out" / "training.json").read_text())
    [source] = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert source["current"]["value"] == "Thanos"
    mixin_file.write_text("datasource: ''\n")
    done = subprocess.run(TRAINGUARD + ["dashboards", "render", "--out", str(tmp_path / "out"), "--mixin",
                                        str(mixin_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "datasource" in done.stderr
