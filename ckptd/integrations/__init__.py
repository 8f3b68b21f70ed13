"""Adapters for the training frameworks that save through a plug-in point of their own.

:mod:`.lightning` (a Lightning ``CheckpointIO``), :mod:`.hf` (a Hugging Face ``TrainerCallback``) and
:mod:`.pointer` (the small JSON file both leave where the framework expects its checkpoint file or
directory: which step of which job holds it). Importing this package imports no framework.
"""
