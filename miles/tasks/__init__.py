"""miles.tasks: where prompts and their references come from.

- :mod:`miles.tasks.largest`, :mod:`miles.tasks.arithmetic`: built-in procedural tasks (exact-answer reward).
- :mod:`miles.tasks.gym`: reasoning-gym datasets (reward: :func:`miles.rewards.gym.gym_reward`).
- :mod:`miles.tasks.dataset`: JSON Lines / JSON / Parquet prompt files via Hugging Face ``datasets``.

A task provides ``sample(n, rng)``, ``eval_problems(n)`` (a held-out split no training prompt is in),
``corpus()`` (tokenizer text) and ``sft_examples(n, rng)`` (warm-start pairs).
"""
