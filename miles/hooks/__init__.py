"""Hook chains: user objects called at named points of the training loop (``hooks:`` in the config).

    python -m miles 'hooks=[{_target_: miles.hooks.EarlyStop, metric: eval/accuracy, target: 0.7}]'

- :mod:`miles.hooks.protocols`: the points, one Protocol each, the context a hook gets (step,
  config, task, metrics, stopping) and the start-up contract check;
- :mod:`miles.hooks.chain`: building the chain, how metrics, stops and errors are handled;
- shipped hooks: :class:`EarlyStop` (stop at a target metric), :class:`Curriculum` (raise the
  task's difficulty as the reward rises), :class:`RewardHackingMonitor` (reward up while response
  length or a reference metric goes down).
"""

from miles.hooks.chain import HookChain, HookContext, HookError, HookSpec, build_hooks
from miles.hooks.curriculum import Curriculum
from miles.hooks.early_stop import EarlyStop
from miles.hooks.protocols import POINTS, check_hook
from miles.hooks.reward_hacking import RewardHackingMonitor

__all__ = [
    "POINTS",
    "Curriculum",
    "EarlyStop",
    "HookChain",
    "HookContext",
    "HookError",
    "HookSpec",
    "RewardHackingMonitor",
    "build_hooks",
    "check_hook",
]
