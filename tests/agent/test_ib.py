"""The ib collector on fixture sysfs trees: two HCAs (mlx5_0 InfiniBand NDR, active; mlx5_1 RoCE, down)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import series, values
from trainguard.agent.collector import Context
from trainguard.agent.collectors.ib import InfiniBandCollector
from trainguard.agent.config import ConfigError
from trainguard.agent.procfs import ParseError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PORT0 = {"device": "mlx5_0", "port": "1"}
PORT1 = {"device": "mlx5_1", "port": "1"}


def collect(sysfs: Path = FIXTURES / "sys", **options):
    return InfiniBandCollector(Context(procfs=FIXTURES / "proc", sysfs=sysfs, options=options)).update()


def test_port_counters_in_bytes_and_states():
    v = values(collect().families)
    # port_rcv_data / port_xmit_data count 4-byte words
    assert v[series("node_infiniband_port_data_received_bytes_total", **PORT0)] == 987654321098 * 4
    assert v[series("node_infiniband_port_data_transmitted_bytes_total", **PORT0)] == 876543210987 * 4
    assert v[series("node_infiniband_port_packets_received_total", **PORT0)] == 1928374655
    assert v[series("node_infiniband_port_errors_received_total", **PORT0)] == 3
    assert v[series("node_infiniband_link_downed_total", **PORT0)] == 2
    assert v[series("node_infiniband_link_downed_total", **PORT1)] == 5
    assert v[series("node_infiniband_port_discards_transmitted_total", **PORT0)] == 7
    assert v[series("node_infiniband_symbol_error_total", **PORT0)] == 11
    assert v[series("node_infiniband_vl15_dropped_total", **PORT0)] == 0
    assert v[series("node_infiniband_state_id", **PORT0)] == 4 and v[series("node_infiniband_state_id", **PORT1)] == 1
    assert v[series("node_infiniband_physical_state_id", **PORT0)] == 5
    assert v[series("node_infiniband_rate_bytes_per_second", **PORT0)] == 400e9 / 8
    assert v[series("node_infiniband_rate_bytes_per_second", **PORT1)] == 1_757_812_500      # 14.0625 Gb/s
    assert v[series("node_infiniband_info", device="mlx5_0", board_id="MT_0000000838", firmware_version="28.39.1002",
                    hca_type="MT4129")] == 1


def test_counter_without_pma_is_left_out():
    v = values(collect().families)
    assert series("node_infiniband_port_transmit_wait_total", **PORT0) in v
    assert series("node_infiniband_port_transmit_wait_total", **PORT1) not in v     # "N/A (no PMA)"


def test_rdma_hardware_counters():
    v = values(collect().families)
    assert v[series("trainguard_infiniband_port_hw_total", **PORT0, counter="out_of_buffer")] == 17
    assert v[series("trainguard_infiniband_port_hw_total", **PORT0, counter="local_ack_timeout_err")] == 4
    assert v[series("trainguard_infiniband_port_hw_total", **PORT1, counter="rnr_nak_retry_err")] == 3
    assert series("trainguard_infiniband_port_hw_total", **PORT0, counter="lifespan") not in v   # a setting


def test_tls_fragment():
    # symbol errors and link downs summed over the ports (the fixture: 11 and 7), for the node-risk rule
    assert collect().tls == {"system": {"ib_ports": 2, "ib_ports_active": 1, "ib_symbol_errors": 11, "ib_link_downed": 7}}


def test_no_infiniband_is_no_metrics_and_no_failure(tmp_path):
    sample = collect(tmp_path)
    assert sample.families == [] and sample.tls == {}


def test_legacy_counters_ext(tmp_path):
    """Kernels before 4.5 put the 64-bit counters in counters_ext/, data in words as well."""
    shutil.copytree(FIXTURES / "sys", tmp_path / "sys")
    ext = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters_ext"
    ext.mkdir()
    (ext / "port_rcv_data_64").write_text("1000\n")
    (ext / "port_unicast_xmit_packets").write_text("77\n")
    v = values(collect(tmp_path / "sys").families)
    assert v[series("node_infiniband_legacy_data_received_bytes_total", **PORT0)] == 4000
    assert v[series("node_infiniband_legacy_unicast_packets_transmitted_total", **PORT0)] == 77


def test_bad_counter_names_its_file(tmp_path):
    shutil.copytree(FIXTURES / "sys", tmp_path / "sys")
    counter = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters" / "link_downed"
    counter.write_text("lots\n")
    with pytest.raises(ParseError, match=r"counters/link_downed:1: field 'link_downed' expected an unsigned integer"):
        collect(tmp_path / "sys")
    rate = counter.parent.parent / "rate"
    counter.write_text("2\n")
    rate.write_text("fast\n")
    with pytest.raises(ParseError, match=r"ports/1/rate:1: field 'rate'"):
        collect(tmp_path / "sys")


def test_no_options():
    with pytest.raises(ConfigError, match="collectors.ib.devices: unknown option"):
        collect(devices=["mlx5_0"])
