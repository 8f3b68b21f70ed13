"""Offline tools over a checkpoint directory, run by the CLI or by hand: no daemon, no process group.
:mod:`.verify` (every checksum, coverage, the stale-step guard; torch-free) and :mod:`.export`
(streaming consolidation into one file)."""
