"""Environment checks: the lock file (exact differences) and the NCCL/torch error-handling variables."""

from __future__ import annotations

import yaml

from trainguard.agent.collector import Context
from trainguard.agent.versions import software_versions
from trainguard.policy import Policy
from trainguard.preflight.environment import check_nccl_env, check_versions, environment, lock_hash

SETTINGS = Policy().preflight


def test_a_fresh_lock_passes_on_this_machine(tmp_path):
    env = environment()
    lock = tmp_path / "env.lock"
    assert check_versions(env, None, lock).status == "pass"
    result = check_versions(environment(), lock, None)
    assert result.status == "pass", result.message
    assert yaml.safe_load(lock.read_text())["torch"] == software_versions(Context())["torch"]


def test_a_changed_lock_fails_with_the_exact_difference(tmp_path):
    env = environment()
    lock = tmp_path / "env.lock"
    check_versions(env, None, lock)
    pinned = yaml.safe_load(lock.read_text())
    pinned.update(torch="2.12.0+cu121", nccl="2.21.5")
    lock.write_text(yaml.safe_dump(pinned))
    result = check_versions(env, lock, None)
    assert result.status == "fail"
    assert f"torch: expected '2.12.0+cu121', found {env['torch']!r}" in result.message
    assert "nccl: expected '2.21.5', found none" in result.message
    assert sorted(result.details["differences"], key=lambda d: d["key"]) == [
        {"key": "nccl", "expected": "2.21.5", "found": ""},
        {"key": "torch", "expected": "2.12.0+cu121", "found": env["torch"]}]


def test_a_lock_pinning_gpus_fails_on_a_node_without_them(tmp_path):
    lock = tmp_path / "env.lock"
    lock.write_text("gpu_name: NVIDIA H100 80GB HBM3\ngpu_count: 8\n")
    result = check_versions(environment(), lock, None)
    assert result.status == "fail"
    assert "gpu_name: expected 'NVIDIA H100 80GB HBM3', found none; gpu_count: expected '8', found none" in result.message


def test_an_unknown_key_or_missing_lock_is_named(tmp_path):
    lock = tmp_path / "env.lock"
    lock.write_text("torch: 2.13.0\ncudnn: 9.1\n")
    result = check_versions(environment(), lock, None)
    assert result.status == "fail" and f"{lock}: cudnn: unknown key" in result.message
    missing = check_versions(environment(), tmp_path / "nope.lock", None)
    assert missing.status == "fail" and "no such lock file" in missing.message


def test_no_lock_given_is_a_skip_not_a_failure():
    assert check_versions(environment(), None, None).status == "skip"


def test_lock_hash_is_stable_and_tells_environments_apart():
    env = {"torch": "2.13.0", "cuda": ""}
    assert lock_hash(env) == lock_hash(dict(reversed(list(env.items()))))
    assert lock_hash(env) != lock_hash({**env, "torch": "2.12.0"})


def test_default_nccl_environment_passes():
    assert check_nccl_env(SETTINGS, {}).status == "pass"
    assert check_nccl_env(SETTINGS, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_IB_TIMEOUT": "20"}).status == "pass"


def test_async_error_handling_off_fails():
    result = check_nccl_env(SETTINGS, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert result.status == "fail" and "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in result.message
    deprecated = check_nccl_env(SETTINGS, {"NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert deprecated.status == "fail" and "NCCL_ASYNC_ERROR_HANDLING=0" in deprecated.message
    # the new name wins over the deprecated one, as in torch
    assert check_nccl_env(SETTINGS, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                     "NCCL_ASYNC_ERROR_HANDLING": "0"}).status == "pass"


def test_insane_timeouts_fail_with_the_value_explained():
    result = check_nccl_env(SETTINGS, {"NCCL_IB_TIMEOUT": "31", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "0",
                                       "TORCH_NCCL_ENABLE_MONITORING": "0"})
    assert result.status == "fail"
    assert "NCCL_IB_TIMEOUT=31 (4.096 us x 2^31 = 8.8e+03 s per retry): expected 14..24" in result.message
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=0" in result.message
    assert "TORCH_NCCL_ENABLE_MONITORING=0" in result.message
    assert len(result.details["problems"]) == 3
