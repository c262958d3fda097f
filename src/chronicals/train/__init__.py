"""The trainer: ``train(config)`` runs setup -> train -> save (see ``loop``); what ``chronicals train`` prints
around it (the held-out answers before and after, the summary) is ``report.RunReport``, its ``report=`` callback."""

from .checkpoint_adapter import apply_checkpoint_adapter
from .checkpoint_model import load_checkpoint_model
from .divergence import TrainingDiverged
from .finish import TrainResult
from .loop import train
from .step import accumulate_gradients, evaluate_loss

__all__ = ["TrainResult", "TrainingDiverged", "accumulate_gradients", "apply_checkpoint_adapter", "evaluate_loss",
           "load_checkpoint_model", "train"]
