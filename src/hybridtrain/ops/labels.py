"""The label convention the loss and the data share (no torch import: ``data/`` reads it too)."""

IGNORE_INDEX = -100  # a label that is not trained on (torch's cross_entropy default)
