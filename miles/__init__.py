"""miles: reinforcement-learning post-training for LLMs, declared in Hydra configs."""

__version__ = "0.1.0"
