"""Training the learned gates (docs/training.md): Probing-RAG probers and CBDR's confidence model, from cached
features."""

from fastgate.train.features import FeatureCache, confidence_features, prober_features
from fastgate.train.fit import FitConfig, FitResult, fit_prober, fit_probers

__all__ = [
    "FeatureCache",
    "FitConfig",
    "FitResult",
    "confidence_features",
    "fit_prober",
    "fit_probers",
    "prober_features",
]
