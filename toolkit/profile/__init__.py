"""Profiles of real models on a corpus: activation outliers (mllm-NPU §3.3) and FFN sparsity
(LLM in a flash). Streaming, mergeable, saved as .npz + JSON metadata, drawn with plotly."""
from .outliers import OutlierStats, calibrate_clips
from .predictor import PredictorReport, train_predictors
from .runner import run
from .sparsity import SparsityStats, calibrate_thresholds

__all__ = ["OutlierStats", "SparsityStats", "calibrate_clips", "calibrate_thresholds", "run",
           "train_predictors", "PredictorReport"]
