"""The deployment files agree with the agent: their config loads, their command lines parse, the unit verifies."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainguard.agent import cli

ROOT = Path(__file__).resolve().parents[2]
KNOWN = {"gpu", "io", "ib", "nccl", "host", "training"}


def parse_agent_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("flag", ["--shadow", "--dry-run"])     # --dry-run: the older name
def test_shadow_flag_sets_shadow_mode_over_the_config(tmp_path, flag):
    config = cli.build_config(parse_agent_args(["--run-dir", str(tmp_path), flag]), KNOWN)
    assert config.webhook["shadow"] is True
    assert cli.build_config(parse_agent_args(["--run-dir", str(tmp_path)]), KNOWN).webhook.get("shadow") is None


def test_daemonset_config_and_args_are_what_the_agent_accepts(tmp_path):
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "daemonset.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"Namespace", "ServiceAccount", "ConfigMap", "PriorityClass", "DaemonSet"}
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(kinds["ConfigMap"]["data"]["agent.yaml"])
    container = kinds["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "agent"
    args = [a.replace("/etc/trainguard/agent.yaml", str(config_file)).replace("$(NODE_NAME)", "gpu-node-7")
            for a in container["args"][1:]]
    config = cli.build_config(parse_agent_args(args), KNOWN)
    assert config.procfs == Path("/host/proc") and config.node == "gpu-node-7"
    assert config.listen_address == ("0.0.0.0", container["ports"][0]["containerPort"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/host/proc", "/host/sys", "/data/runs"} <= mounts
    assert config.runs_root == Path("/data/runs") and config.run_dir is None    # follows the jobs as they come
    assert config.coexist == "on"
    token_dir = str(Path(config.webhook["token_file"]).parent)
    assert token_dir in mounts
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"] == "256Mi"


def test_systemd_unit_command_parses_and_the_unit_verifies(tmp_path):
    unit = (ROOT / "deploy" / "trainguard-agent.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.MULTILINE).group(1)
    words = shlex.split(exec_start.replace("${TRAINGUARD_RUN_DIR}", "/data/runs/current"))
    assert words[0].endswith("/trainguard") and words[1] == "agent"
    example = ROOT / "agent" / "configs" / "agent.yaml"
    args = [w.replace("/etc/trainguard/agent.yaml", str(example)) for w in words[2:]]
    config = cli.build_config(parse_agent_args(args), KNOWN)
    assert config.run_dir == Path("/data/runs/current") and config.listen == "127.0.0.1:9655"
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    local = tmp_path / "trainguard-agent.service"
    local.write_text(unit.replace(words[0], str(Path(sys.executable).with_name("trainguard"))))
    result = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_daemonset_can_do_what_the_agent_needs_and_yields_to_the_run():
    """py-spy needs SYS_PTRACE; root training containers need a root agent (with few capabilities); NVML
    needs the nvidia runtime class; the agent's priority is below the training pods', as its comment says."""
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "daemonset.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    security = container["securityContext"]
    assert {"SYS_PTRACE", "SYSLOG", "KILL"} <= set(security["capabilities"]["add"])
    assert security["capabilities"]["drop"] == ["ALL"] and security["allowPrivilegeEscalation"] is False
    assert security["runAsUser"] == 0
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    priority = kinds["PriorityClass"]
    assert pod["priorityClassName"] == priority["metadata"]["name"] and priority["value"] < 0
    assert priority["preemptionPolicy"] == "Never" and not priority["globalDefault"]
    annotations = kinds["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(container["ports"][0]["containerPort"]) == "9655"


def test_systemd_unit_allows_py_spy_and_run_directories_under_home():
    unit = (ROOT / "deploy" / "trainguard-agent.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert "CAP_SYS_PTRACE" in settings["AmbientCapabilities"].split()
    assert "CAP_SYS_PTRACE" in settings["CapabilityBoundingSet"].split()
    assert settings.get("ProtectHome", "false") in ("false", "no")
