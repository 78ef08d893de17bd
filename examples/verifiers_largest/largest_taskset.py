"""A verifiers taskset written with verifiers' own classes (verifiers 0.4.0, ``verifiers.v1``), for
``task=verifiers``: the largest of five numbers in [0, 99], task ``i`` drawn from ``random.Random(i)``,
in the prompt format of miles' built-in ``largest`` task (so a fresh tiny model can warm-start on it).
Its reward: 1.0 when the reply is exactly the largest number (surrounding whitespace ignored).

verifiers finds it by id: the module ``largest_taskset`` (this file's directory on ``sys.path``, which
``task.source.paths`` does) and its one ``Taskset`` in ``__all__``. It needs nothing of miles.
"""

import random

import verifiers.v1 as vf


class LargestData(vf.TaskData):
    answer: str = ""


class LargestTask(vf.Task[LargestData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if (trace.last_reply or "").strip() == self.data.answer else 0.0


class LargestConfig(vf.TasksetConfig):
    num_tasks: int = 2000


class LargestTaskset(vf.Taskset[LargestTask, LargestConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            rng = random.Random(i)
            numbers = [rng.randint(0, 99) for _ in range(5)]
            yield LargestTask(LargestData(id=str(i), prompt=f"Which is largest: {' '.join(map(str, numbers))}?",
                                          answer=str(max(numbers))), self.config.task)


__all__ = ["LargestTaskset"]
