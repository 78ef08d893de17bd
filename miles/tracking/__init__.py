"""Experiment tracking: what a run records about itself, and where.

- :mod:`~miles.tracking.mlflow_tracker`: one MLflow run per job (``make_tracker``).
- :mod:`~miles.tracking.snapshot`: config, command line, code version, packages, machine; secret redaction.
- :mod:`~miles.tracking.outbox`: a background sender, so that the tracking server never stops training.
- :mod:`~miles.tracking.plots`: the run's history and its PNG plots.
- :mod:`~miles.tracking.sweep`: ``-m`` sweeps as a parent run with one child per job and a summary.

``miles reproduce RUN_ID`` (:mod:`miles.reproduce`) runs a logged run again.
"""
