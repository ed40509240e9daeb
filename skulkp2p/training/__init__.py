"""Drafting heads: train one for a model that has none, publish a checkpoint's own, and probe a
trained one (`python -m skulkp2p head ...`).

head_options.py builds the sub-commands' parsers and imports no mlx (the CLI builds its parser
before the fast BLAS is set up); head_command.py runs them, importing the rest lazily. The rest:
sidecar_prompts.py and prompt_batches.py (what the model answers), shards.py (its answers with
the trunk's features and targets), head_init.py (the starting head), head_fit.py (the loss and
the training batches), heldout.py (acceptance replayed through the engine's decode loop),
train_run.py (the bounded, resumable run), publish.py (sidecar files and their provenance),
vocab_probe.py and validation_shards.py (choosing a trained head's settings).

The engine never imports this package.
"""
