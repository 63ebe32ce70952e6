"""IO and NCCL: disk await, data loader starvation, communication overhead, the NCCL watchdog
(io-nccl.rules.yml).
"""

from __future__ import annotations

from trainguard import actions
from trainguard.alerts.promql import NODE, RATE, Alert, Group, Record, num
from trainguard.policy import Policy


def io_nccl(policy: Policy) -> list[Group]:
    a = policy.alerts
    records = Group("io-nccl", "trainguard-io-nccl.records", (
        # Average time per completed operation, as iostat's await: time spent / operations.
        Record("instance_device:node_disk_await:seconds",
               f"(rate(node_disk_read_time_seconds_total[{RATE}]) + rate(node_disk_write_time_seconds_total[{RATE}]))\n"
               f"/ (rate(node_disk_reads_completed_total[{RATE}]) + rate(node_disk_writes_completed_total[{RATE}]) > 0)"),
        # Per-step timings are gauges of each rank's latest step; their means over the window are a
        # sample of the window's steps.
        Record("trainguard:data_wait:ratio",
               f"avg_over_time(trainguard_training_data_wait_seconds[{RATE}])\n"
               f"/ (avg_over_time(trainguard_training_step_time_seconds[{RATE}]) > 0)"),
        Record("trainguard:comm_overhead:ratio",
               f"avg_over_time(trainguard_training_comm_seconds[{RATE}])\n"
               f"/ (avg_over_time(trainguard_training_step_time_seconds[{RATE}]) > 0)"),
    ))
    alerts = Group("io-nccl", "trainguard-io-nccl.alerts", (
        Alert("DiskAwaitHigh", "instance_device:node_disk_await:seconds > " + num(a.disk_await_ms / 1000.0),
              "warning", "Disk {{ $labels.device }} on {{ $labels.instance }} averages "
              "{{ $value | humanizeDuration }} per operation",
              f"Average disk await is above {num(a.disk_await_ms)} ms over {RATE}: data loading and "
              "checkpoint writes on this disk are slow.",
              for_=a.for_long),
        Alert("DataLoaderStarved", "trainguard:data_wait:ratio > " + num(a.data_wait_ratio),
              "warning", "Ranks of run {{ $labels.run_id }} on {{ $labels.instance }} wait for data {{ $value | humanizePercentage }} of the time",
              f"More than {a.data_wait_ratio:.0%} of step time is spent waiting for the next batch: add "
              "loader workers, prefetch, or move the data to faster storage.",
              for_=a.for_long),
        Alert("CommOverheadHigh", "trainguard:comm_overhead:ratio > " + num(a.comm_overhead_max),
              "warning", "Communication takes {{ $value | humanizePercentage }} of step time in run {{ $labels.run_id }} on {{ $labels.instance }}",
              f"More than {a.comm_overhead_max:.0%} of step time is spent in collectives: a slow link, a "
              "straggler rank, or buckets too small to overlap with compute.",
              for_=a.for_long),
        Alert("NCCLWatchdogTimeout",
              f'sum by ({NODE}) (increase(trainguard_nccl_events_total{{kind=~"watchdog_timeout|watchdog_stuck"}}[{RATE}])) > 0',
              "critical", "NCCL watchdog timed out on {{ $labels.instance }}",
              "A collective did not finish within the process group's timeout: a rank is hung or a link "
              "is down. The agent ends the node's ranks; torch's elastic launcher starts them again from "
              "the latest verified checkpoint.",
              action=actions.RESTORE),
    ))
    return [records, alerts]
