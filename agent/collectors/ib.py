"""InfiniBand / RoCE ports from <sysfs>/class/infiniband/*/ports/*, with node_exporter's names and units.

Names, labels and conversions are node_exporter's infiniband collector's (port data in bytes: the kernel
counts 4-byte words; rate in bytes per second), so its dashboards and alerts work on these series unchanged;
tests/agent/test_node_exporter_crosscheck.py compares the two on the same sysfs. The RDMA hardware counters
(hw_counters/: retransmits, timeouts, out-of-buffer, CNPs) that node_exporter leaves out are what a
stalled all-reduce over RoCE shows first, so they are exported too, under trainguard_.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from ..collector import Collector, Sample, register
from trainguard.metrics.families import LabelCache, Spec
from ..procfs import IBDevice, read_infiniband
from .options import options

PORT_LABELS = ["device", "port"]

# sysfs file -> (node_infiniband_ name without _total, help); counters/ then counters_ext/ (kernels < 4.5)
COUNTERS = {
    "excessive_buffer_overrun_errors": ("excessive_buffer_overrun_errors",
                                        "Number of times that OverrunErrors consecutive flow control update "
                                        "periods occurred, each having at least one overrun error."),
    "link_downed": ("link_downed", "Number of times the link failed to recover from an error state and went down"),
    "link_error_recovery": ("link_error_recovery",
                            "Number of times the link successfully recovered from an error state"),
    "local_link_integrity_errors": ("local_link_integrity_errors",
                                    "Number of times that the count of local physical errors exceeded the "
                                    "threshold specified by LocalPhyErrors."),
    "multicast_rcv_packets": ("multicast_packets_received", "Number of multicast packets received (including errors)"),
    "multicast_xmit_packets": ("multicast_packets_transmitted",
                               "Number of multicast packets transmitted (including errors)"),
    "port_rcv_constraint_errors": ("port_constraint_errors_received",
                                   "Number of packets received on the switch physical port that are discarded"),
    "port_xmit_constraint_errors": ("port_constraint_errors_transmitted",
                                    "Number of packets not transmitted from the switch physical port"),
    "port_rcv_data": ("port_data_received_bytes", "Number of data octets received on all links"),
    "port_xmit_data": ("port_data_transmitted_bytes", "Number of data octets transmitted on all links"),
    "port_rcv_discards": ("port_discards_received",
                          "Number of inbound packets discarded by the port because the port is down or congested"),
    "port_xmit_discards": ("port_discards_transmitted",
                           "Number of outbound packets discarded by the port because the port is down or congested"),
    "port_rcv_errors": ("port_errors_received", "Number of packets containing an error that were received on this port"),
    "port_rcv_packets": ("port_packets_received",
                         "Number of packets received on all VLs by this port (including errors)"),
    "port_xmit_packets": ("port_packets_transmitted",
                          "Number of packets transmitted on all VLs from this port (including errors)"),
    "port_xmit_wait": ("port_transmit_wait", "Number of ticks during which the port had data to transmit but no "
                                             "data was sent during the entire tick"),
    "unicast_rcv_packets": ("unicast_packets_received", "Number of unicast packets received (including errors)"),
    "unicast_xmit_packets": ("unicast_packets_transmitted", "Number of unicast packets transmitted (including errors)"),
    "port_rcv_remote_physical_errors": ("port_receive_remote_physical_errors",
                                        "Number of packets marked with the EBP (End of Bad Packet) delimiter "
                                        "received on the port."),
    "port_rcv_switch_relay_errors": ("port_receive_switch_relay_errors",
                                     "Number of packets that could not be forwarded by the switch."),
    "symbol_error": ("symbol_error", "Number of minor link errors detected on one or more physical lanes."),
    "VL15_dropped": ("vl15_dropped", "Number of incoming VL15 packets dropped due to resource limitations."),
}
COUNTERS_EXT = {
    "port_multicast_rcv_packets": ("legacy_multicast_packets_received", "Number of multicast packets received"),
    "port_multicast_xmit_packets": ("legacy_multicast_packets_transmitted", "Number of multicast packets transmitted"),
    "port_rcv_data_64": ("legacy_data_received_bytes", "Number of data octets received on all links"),
    "port_rcv_packets_64": ("legacy_packets_received", "Number of data packets received on all links"),
    "port_unicast_rcv_packets": ("legacy_unicast_packets_received", "Number of unicast packets received"),
    "port_unicast_xmit_packets": ("legacy_unicast_packets_transmitted", "Number of unicast packets transmitted"),
    "port_xmit_data_64": ("legacy_data_transmitted_bytes", "Number of data octets transmitted on all links"),
    "port_xmit_packets_64": ("legacy_packets_transmitted", "Number of data packets received on all links"),
}
STRICT = frozenset(COUNTERS) | frozenset(COUNTERS_EXT)


@register
class InfiniBandCollector(Collector):
    name = "ib"
    interval = 5.0
    timeout = 10.0

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        options(ctx.options, self.name)   # no options of its own; an unknown key is an error

    def update(self) -> Sample:
        devices = read_infiniband(self.ctx.sysfs, STRICT)
        return Sample(families=families(devices), tls=_tls(devices))


INFO = Spec("gauge", "node_infiniband_info", "Non-numeric data from /sys/class/infiniband/<device>, value is always 1.",
            ["device", "board_id", "firmware_version", "hca_type"])
STATE = Spec("gauge", "node_infiniband_state_id", "State of the InfiniBand port (0: no change, 1: down, 2: init, "
             "3: armed, 4: active, 5: act defer)", PORT_LABELS)
PHYSICAL_STATE = Spec("gauge", "node_infiniband_physical_state_id", "Physical state of the InfiniBand port (0: no "
                      "change, 1: sleep, 2: polling, 3: disable, 4: shift, 5: link up, 6: link error recover, "
                      "7: phytest)", PORT_LABELS)
RATE = Spec("gauge", "node_infiniband_rate_bytes_per_second", "Maximum signal transfer rate", PORT_LABELS)
COUNTER_SPECS = {file: Spec("counter", f"node_infiniband_{name}", help_, PORT_LABELS)
                 for table in (COUNTERS, COUNTERS_EXT) for file, (name, help_) in table.items()}
HW = Spec("counter", "trainguard_infiniband_port_hw", "RDMA hardware counters of the port from sysfs hw_counters/ "
          "(retransmits, ack timeouts, out-of-buffer drops, CNPs), by file name.", [*PORT_LABELS, "counter"])
_PORT = LabelCache(PORT_LABELS)
_HW_COUNTER = LabelCache(HW.label_names)


def families(devices: list[IBDevice]) -> list[Metric]:
    """The metric families for these HCAs (pure: tests and the cross-check render them directly)."""
    info = [(INFO.labels(d.name, d.board_id, d.firmware_version, d.hca_type), 1) for d in devices]
    state, phys, rate, hw = [], [], [], []
    counters: dict[str, list] = {file: [] for file in COUNTER_SPECS}
    for device in devices:
        for port in device.ports:
            labels = _PORT.get(device.name, str(port.port))
            state.append((labels, port.state_id))
            phys.append((labels, port.phys_state_id))
            rate.append((labels, port.rate_bytes_per_second))
            for file, value in (*port.counters.items(), *port.counters_ext.items()):
                if file in counters:
                    counters[file].append((labels, value))
            hw += [(_HW_COUNTER.get(device.name, str(port.port), name), value)
                   for name, value in port.hw_counters.items()]
    every = [(INFO, info), (STATE, state), (PHYSICAL_STATE, phys), (RATE, rate),
             *((COUNTER_SPECS[file], samples) for file, samples in counters.items()), (HW, hw)]
    return [spec.family(samples) for spec, samples in every if samples]


def _tls(devices: list[IBDevice]) -> dict:
    ports = [port for device in devices for port in device.ports]
    if not ports:
        return {}
    system = {"ib_ports": len(ports), "ib_ports_active": sum(p.state_id == 4 for p in ports)}
    # the node's link health as the node-risk rule reads it (decide/node_risk.py), summed over its ports
    for tls_key, file in (("ib_symbol_errors", "symbol_error"), ("ib_link_downed", "link_downed")):
        found = [p.counters.get(file, p.counters_ext.get(file)) for p in ports]
        if any(v is not None for v in found):
            system[tls_key] = sum(v for v in found if v is not None)
    return {"system": system}
