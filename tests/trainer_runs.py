"""Running the real Trainer from a test: to the end, or killed right after a checkpoint."""

from __future__ import annotations

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer


def run_training(argv: list[str], crash_after_step: int | None = None,
                 keep_process_group: bool = False) -> dict[int, float]:
    """Train the job of ``argv``; the global loss of every logged step. With
    ``crash_after_step`` the run dies (KeyboardInterrupt) right after saving that step.
    ``keep_process_group``: leave torch.distributed up for the next run (several jobs in one
    torchrun launch)."""
    trainer = Trainer(ConfigManager().parse_args(argv))
    if crash_after_step is not None:
        save = trainer.checkpointer.save

        def save_then_die(step, **kw):
            save(step, **kw)
            if step == crash_after_step:
                raise KeyboardInterrupt("simulated kill")

        trainer.checkpointer.save = save_then_die
    try:
        return trainer.train()
    finally:
        trainer.close()
        if not keep_process_group:
            destroy_distributed()
