"""The TLS event types: every `event.type` a trainguard writer records, with what each means.

A TLS v1 record's `event` section is ``{"type": <one of these>, ...}`` (docs/trainer.md, the published
schema trainguard/schema/tls-v1.schema.json). Writers and readers import the name from here rather than
spelling it; tests/test_vocabulary.py rejects the literal elsewhere in the product. A decision of the guard,
the cost policy or the webhook is recorded as an event whose type is the action's own name (`skip_step`,
`rollback`, `restore`, `stop`, `cost_*`): those names belong to trainguard/actions.py, and so do the two
types below that are the action table's (`cordon`, `shadow_action`).

Pure: no I/O. A new event type: its constant and one line here, then its writer and its readers.
"""

from __future__ import annotations

from trainguard import actions

# ------------------------------------------------------------------------ a trainer process's life
RUN_START = "run_start"            # a trainer process began stepping (after its restore): resumed_from, mfu_unavailable
RUN_END = "run_end"                # a trainer process ended on purpose: reason (completed, guard_stop, cost_stop)

# ------------------------------------------------------------------------------------ checkpoints
CHECKPOINT_SAVED = "checkpoint_saved"              # a checkpoint written and verified: path, stable, seconds
CHECKPOINT_FAILED = "checkpoint_failed"            # a save that did not complete: reason, bytes_needed, bytes_free
CHECKPOINT_RESTORED = "checkpoint_restored"        # training state loaded from a verified checkpoint
CHECKPOINT_INVALID = "checkpoint_invalid"          # one a restore skipped, failing verification: code, reason
CHECKPOINT_DELETED = "checkpoint_deleted"          # retention removed a checkpoint: reason (retention, superseded)
CHECKPOINT_QUARANTINED = "checkpoint_quarantined"  # one it cannot verify moved aside, never deleted
CHECKPOINT_SUPERSEDED = "checkpoint_superseded"    # one newer than a rollback's step set aside: kept_step
CHECKPOINT_INTERVAL = "checkpoint_interval"        # the autopilot applied a new interval: applied_seconds, inputs
SNAPSHOT_SAVED = "snapshot_saved"          # an in-memory snapshot written: bytes, blocking_seconds, write_seconds
SNAPSHOT_PACED = "snapshot_paced"          # rank 0 moved the snapshot interval to its cost budget: snapshot_every,
                                           # given, cost_seconds, step_seconds, budget

# ------------------------------------------------ recovery in seconds (docs/recovery.md)
SNAPSHOT_SKIPPED = "snapshot_skipped"      # a snapshot not taken or not written: why (too large, no room, error)
SNAPSHOT_INVALID = "snapshot_invalid"      # a snapshot a restore refused, failing verification: snapshot_step, reason
SNAPSHOT_RESTORED = "snapshot_restored"    # training state loaded from a verified in-memory snapshot: restored_step
SNAPSHOT_FALLBACK = "snapshot_fallback"    # no snapshot every rank could verify: the durable checkpoint instead, why
IN_PROCESS_RESTART = "in_process_restart"  # the ranks re-formed their group in-process and restored: teardown,
                                           # reform and restore seconds, cause, failed_rank, steps_lost
SNAPSHOT_REPLICATED = "snapshot_replicated"   # a snapshot held by a rank of another node: peer_rank, bytes, seconds
SNAPSHOT_REPLICA_FAILED = "snapshot_replica_failed"   # a snapshot its peer does not hold: peer_rank, why
REPLICA_REFUSED = "replica_refused"        # a received replica that did not verify, kept nowhere: origin_rank, reason
RECOVERY_REQUEST = "recovery_request"      # a rank took an agent's signed request to recover in-process: request, by
RECOVERY_REQUEST_REFUSED = "recovery_request_refused"   # a request no rank acts on (unsigned, forged, copied): why

# -------------------------------------------------------------------- decisions and what was done
ALERT = "alert"                    # an alert notification the agent decided on: alertname, status, outcome
ACTION = "action"                  # an action carried out, claimed, refused or failed: action, outcome
SHADOW_ACTION = actions.SHADOW_ACTION  # an action decided and not carried out (shadow mode): action, evidence
CONTROL_REFUSED = "control_refused"            # a control request that did not prove who wrote it: why
STOP_MARKER_REFUSED = "stop_marker_refused"    # a RUN/control/stopped.json rank 0 did not sign: why
LOSS_LEVEL_SHIFT = "loss_level_shift"          # the guard accepted a new loss level: loss_before, loss_after

# ------------------------------------------------------------------------- silent data corruption
REPLICA_CHECK = "replica_check"        # the replicas' weight and gradient fingerprints at a check step
REPLICA_MISMATCH = "replica_mismatch"  # replicas that should agree did not: ranks, what (docs/sdc.md)
CULPRIT = "culprit"                    # the rank and node an incident names: incident, rank, node, kind
CORDON = actions.CORDON                # a node kept out of the job (RUN/control/cordon/<host>): host, incident
CORDON_IGNORED = "cordon_ignored"      # a launcher joined despite a cordon file it does not honour: why
SPARE_JOINED = "spare_joined"          # a spare node took a cordoned node's place: host, replaces, cordon_id

# ------------------------------------------------------------------------------------- node health
HEALTH_CHECK = "health_check"    # another tool's finding on a node (dcgmi diag, NCCL RAS, kernel NVRM): tool, status, id
NODE_AT_RISK = "node_at_risk"    # the node-risk rule flagged this node (decide/node_risk.py): score, signals

# ------------------------------------------------------------------------------------- schedules
EVALUATION = "evaluation"          # a validation pass: val_loss (and dataset, purpose)
LR_PHASE = "lr_phase"              # the learning-rate schedule entered a phase: phase, schedule, from
LAYER_REINIT = "layer_reinit"      # a layer's weights re-initialised by the layer response: layer
FAULT_INJECTED = "fault_injected"  # an injected fault (`--inject`, preflight's drill) fired: kind, fault

# ------------------------------------------------------------------------ imported from other logs
TRAINER_LOG = "trainer_log"        # a Hugging Face Trainer log entry's own numbers
TRAINER_CHECKPOINT_SIGNED = "trainer_checkpoint_signed"   # a Hugging Face Trainer checkpoint folder signed
PREDICTION = "prediction"          # a Hugging Face predict_* entry (no step of its own)
RUN_SUMMARY = "run_summary"        # a log's closing summary numbers (Hugging Face, TensorBoard)

# Every type above: tests/test_vocabulary.py rejects these names spelled anywhere else in the product.
TYPES: tuple[str, ...] = (RUN_START, RUN_END, CHECKPOINT_SAVED, CHECKPOINT_FAILED, CHECKPOINT_RESTORED, CHECKPOINT_INVALID,
         CHECKPOINT_DELETED, CHECKPOINT_QUARANTINED, CHECKPOINT_SUPERSEDED, CHECKPOINT_INTERVAL, SNAPSHOT_SAVED,
         SNAPSHOT_PACED,
         ALERT, ACTION, SHADOW_ACTION,
         CONTROL_REFUSED, STOP_MARKER_REFUSED, LOSS_LEVEL_SHIFT, REPLICA_CHECK, REPLICA_MISMATCH, CULPRIT,
         CORDON, CORDON_IGNORED, SPARE_JOINED, EVALUATION, LR_PHASE, LAYER_REINIT, FAULT_INJECTED, TRAINER_LOG,
         TRAINER_CHECKPOINT_SIGNED, PREDICTION, RUN_SUMMARY, HEALTH_CHECK, NODE_AT_RISK, SNAPSHOT_SKIPPED,
         SNAPSHOT_INVALID, SNAPSHOT_RESTORED, SNAPSHOT_FALLBACK, IN_PROCESS_RESTART,
         SNAPSHOT_REPLICATED, SNAPSHOT_REPLICA_FAILED, REPLICA_REFUSED, RECOVERY_REQUEST, RECOVERY_REQUEST_REFUSED)
