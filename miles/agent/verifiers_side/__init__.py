"""Modules that run in verifiers' venv (scripts/setup_verifiers.sh), started by :mod:`miles.agent.verifiers`;
miles never imports them: :mod:`runner` loads the environment, :mod:`miles_chat` is its default harness."""
