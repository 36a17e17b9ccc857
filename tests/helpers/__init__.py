"""Helpers shared by the test files, one module per concern:

* :mod:`tests.helpers.data`: the synthetic SFT generator (prompt-masked rows, packed or not),
  batches made by the project's own collators, the test tokenizer and reference data.
* :mod:`tests.helpers.models`: the tiny models (the tiny Nemotron-H, a small stand-in model).
* :mod:`tests.helpers.hf`: moving weights between our model and transformers', references.
* :mod:`tests.helpers.recipes`: recipe dicts for the tiny model, CLI overrides of short runs.
* :mod:`tests.helpers.training`: a trainer over the tiny model and the synthetic data.
* :mod:`tests.helpers.distributed`: a launcher of N gloo ranks running one function.
* :mod:`tests.helpers.parity`: layout-parity runs through the recipe's builder and the trainer.
"""
