"""`python -m engine train-draft`: train a DFlash draft for a target from the target's own greedy answers
(docs/training.md). One module per job:

- settings.py: the recipe (TrainSettings), one field per command-line option;
- corpus.py and data.py: prompts from templates and written by the target, its greedy answers, batches drawn on the
  device;
- features.py: the target's context features, computed once into a feature bank (float8 when only that fits) or in
  every step;
- draft_pass.py: the draft's initial weights and its differentiable training pass (DFlashDrafter.propose for many
  anchors at once);
- loss.py: the weighted block cross-entropy (optionally distilled) and the teacher-forced acceptance;
- schedule.py: the learning rate and the step count that fits a time budget;
- loop.py: the run folder, the step (one CUDA graph on a GPU), validation, checkpoints and the DFlash draft.

The DFlash writer, save_dflash, sits beside its reader in engine/loading.py; the held-out check is
engine.measure.heldout_acceptance.
"""
from .loop import TrainResult, train
from .settings import TrainSettings

__all__ = ["TrainResult", "TrainSettings", "train"]
