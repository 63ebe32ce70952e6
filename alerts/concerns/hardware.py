"""Hardware: GPU temperature, Xid errors, allocator fragmentation, node risk (hardware.rules.yml)."""

from __future__ import annotations

from trainguard.alerts.promql import RATE, Alert, Group, Record, num
from trainguard.policy import Policy


def hardware(policy: Policy) -> list[Group]:
    a = policy.alerts
    records = Group("hardware", "trainguard-hardware.records", (
        Record("trainguard:memory_fragmentation:ratio",
               "trainguard_training_memory_allocated_bytes\n"
               "/ (trainguard_training_memory_reserved_bytes > 0)"),
    ))
    alerts = Group("hardware", "trainguard-hardware.alerts", (
        Alert("GPUOverheating", "DCGM_FI_DEV_GPU_TEMP > " + num(a.gpu_temp_c),
              "warning", "GPU {{ $labels.gpu }} on {{ $labels.instance }} at {{ $value }} °C",
              f"The GPU is above {num(a.gpu_temp_c)} °C and will throttle its clocks, slowing every rank "
              "that waits for it. Check airflow, fans and the power limit.",
              for_=a.for_long),
        Alert("GPUXidError", f"increase(trainguard_gpu_xid_errors_total[{RATE}]) > 0",
              "critical", "Xid {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
              "The driver reported an Xid error (NVML events and the kernel log). Some (48, 63, 64, 74, 79, "
              "94, 95) mean the GPU needs a reset or the node needs draining; see the runbook before "
              "restarting the run here."),
        Alert("GPUMemoryFragmented", "trainguard:memory_fragmentation:ratio < " + num(a.fragmentation_min),
              "warning", "Allocator memory fragmented in run {{ $labels.run_id }} on {{ $labels.instance }}: "
              "{{ $value | humanizePercentage }} of reserved memory in use",
              f"Allocated / reserved device memory is under {num(a.fragmentation_min)}: the caching "
              "allocator holds blocks it cannot reuse, which ends in out-of-memory errors at a "
              "batch that used to fit.",
              for_=a.for_long),
        Alert("NodeAtRisk",
              "trainguard_node_risk_score and on (job, instance) (trainguard_node_at_risk == 1)",
              "critical", "Node {{ $labels.instance }} at hardware risk (score {{ $value }})",
              f"The node's hardware trends (ECC, remapped rows, XIDs by class, PCIe, NVLink, InfiniBand, "
              f"thermal) have held its risk score at or above {num(policy.node_risk.threshold)} for "
              f"{policy.node_risk.consecutive} readings in a row. The agent drains it at the next checkpoint "
              "(a checkpoint now, a signed cordon, the elastic shrink) unless the run is in shadow mode; "
              "trainguard_node_risk_signal says which signals weigh."),
        Alert("GPUUncorrectableECC", f"increase(trainguard_gpu_ecc_uncorrectable_errors_total[{RATE}]) > 0",
              "critical", "Uncorrectable ECC error on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
              "The GPU's memory had an error ECC could not correct: the data read was wrong (a contained "
              "error ends the process that read it, XID 94; an uncontained one, XID 95, the GPU's work). "
              "The node-risk rule counts it as a hard signal; see the runbook."),
        Alert("NodeRiskFlagsSuppressed", "increase(trainguard_node_risk_suppressed_total[1h]) > 0",
              "warning", "Node {{ $labels.instance }} at risk but not drained: the fleet's budget is spent",
              f"More than {policy.node_risk.max_flags_per_hour} nodes were at hardware risk within an hour, "
              "so the node-risk rule's circuit breaker stopped draining more. Many nodes at once is "
              "more often a fleet-wide cause (a driver or firmware roll-out, a cooling or power event) "
              "than many failing GPUs: a human decides."),
    ))
    return [records, alerts]
