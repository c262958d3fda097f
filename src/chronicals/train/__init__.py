"""The trainer: ``train(config)`` runs setup -> train -> save (see ``loop``); the demo lives in ``demo``."""

from .divergence import TrainingDiverged
from .finish import TrainResult
from .loop import train
from .step import accumulate_gradients, evaluate_loss

__all__ = ["TrainResult", "TrainingDiverged", "accumulate_gradients", "evaluate_loss", "train"]
