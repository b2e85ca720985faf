"""The trainer's tiny target and its self-distillation shards, as module fixtures."""

from model_testing import data_dir, target  # noqa: F401 (fixtures)
