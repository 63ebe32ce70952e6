"""Recovery in seconds (docs/recovery.md): the in-memory snapshot tier and the in-process restart.

- snapshot.py: every rank's whole train state in host memory (/dev/shm) every few steps, staged beside
  the step and written by a thread; signed with the run's key and hashed; read back only once verified.
- inprocess.py: the job's store and the process group's generations: on a rank's failure the surviving
  processes abort the group, meet at a barrier in the store, re-form it, and go on in the same interpreter.
- restore.py: which state every rank loads after a failure (the newest snapshot all ranks verify, else the
  durable checkpoint, loudly), the same on every rank.
"""
