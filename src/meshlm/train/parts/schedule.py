"""Which steps evaluate and which save: ``train.eval_every``, ``train.checkpoint_every``.

Evaluation runs at step 1, every ``eval_every`` steps and at the last step (0: never); a
checkpoint is saved every ``checkpoint_every`` steps (0: none between) and at the last step.
No communication, no memory.
"""

from __future__ import annotations

from ...config import TrainSection


def is_eval_step(train: TrainSection, step: int) -> bool:
    every = train.eval_every
    return every > 0 and (step == 1 or step % every == 0 or step == train.steps)


def is_save_step(train: TrainSection, step: int) -> bool:
    every = train.checkpoint_every
    return bool(every and step % every == 0) or step == train.steps
