"""NVIDIA's XID codes that matter to a training run, each with the class of action the XID catalogue gives it.

Pure data, no I/O: the gpu collector labels its XID counters with the class, the node-risk rule
(decide/node_risk.py) weighs XIDs by it, the alerts route on it.

The class follows the "Resolution Bucket (Immediate Action)" column of NVIDIA's XID catalogue for Ampere and
later GPUs (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and the older XID table's "possible
causes" (docs.nvidia.com/deploy/xid-errors): RESTART_APP and IGNORE are an application error (the job that hit
it is at fault, or is told of an error another part already handled), GSP and micro-controller faults are the
driver or firmware, RESET_GPU (and the ECC/NVLink workflows that end in a reset) needs a GPU reset, and
RESTART_BM or a hardware service call needs the node drained. A code the table does not know is "unknown":
counted, never zero-filled, never weighed as a failure.

Codes listed in WATCHED are exported at zero from the agent's start for every GPU, so the first one is an
increase Prometheus sees (dcgm-exporter #190/#500/#502: a last-value gauge hides the second XID of a code).
"""

from __future__ import annotations

APPLICATION = "application_error"
DRIVER = "driver_firmware"
RESET = "gpu_reset"
DRAIN = "node_drain"
UNKNOWN = "unknown"
CLASSES = (APPLICATION, DRIVER, RESET, DRAIN)

# code -> (class, what the driver means by it), the catalogue's mnemonic shortened
XIDS: dict[int, tuple[str, str]] = {
    13: (APPLICATION, "graphics engine exception"),
    31: (APPLICATION, "GPU memory page fault (MMU)"),
    43: (APPLICATION, "GPU stopped processing (channel reset by the application)"),
    45: (APPLICATION, "preemptive cleanup after an earlier error"),
    48: (RESET, "double-bit (uncorrectable) ECC error"),
    61: (DRIVER, "internal micro-controller breakpoint"),
    62: (DRIVER, "internal micro-controller halt"),
    63: (RESET, "ECC page retirement or row remapping recorded (a reset applies it)"),
    64: (DRAIN, "ECC page retirement or row remapping failed"),
    68: (APPLICATION, "video decoder exception"),
    69: (APPLICATION, "graphics engine class error"),
    74: (RESET, "NVLink error"),
    79: (DRAIN, "GPU has fallen off the bus"),
    92: (APPLICATION, "high single-bit ECC error rate (corrected)"),
    94: (APPLICATION, "contained ECC error (only the process that touched it is hit)"),
    95: (RESET, "uncontained ECC error"),
    109: (APPLICATION, "context switch timeout"),
    119: (DRIVER, "GSP RPC timeout"),
    120: (DRIVER, "GSP error"),
    140: (RESET, "unrecovered ECC error"),
    143: (DRAIN, "GPU initialization failure"),
    154: (RESET, "GPU recovery action changed (the driver asks for a reset or more)"),
}

# Exported at zero from the start: the codes above, in order (22 series per GPU).
WATCHED: tuple[int, ...] = tuple(sorted(XIDS))


def class_of(code: int) -> str:
    """The catalogue class of an XID code, "unknown" for one this table does not list."""
    entry = XIDS.get(code)
    return entry[0] if entry else UNKNOWN


def meaning(code: int) -> str:
    entry = XIDS.get(code)
    return entry[1] if entry else "not in trainguard's XID table"
