"""Adapters for the training frameworks that save through a plug-in point of their own.

:mod:`.lightning` (a Lightning ``CheckpointIO``), :mod:`.hf` (a Hugging Face ``TrainerCallback``),
:mod:`.torchtitan` (torchtitan's ``CheckpointManager`` over :mod:`ckptd.dcp`) and :mod:`.pointer` (the small
JSON file the first two leave where the framework expects its checkpoint file or directory: which step of
which job holds it). Importing this package imports no framework; each module imports its own.
"""
