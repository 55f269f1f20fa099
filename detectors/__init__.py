"""Retrieval-trigger detectors for dynamic RAG: feature extraction, models, baselines and registry."""

__all__ = ["load_detector"]


def __getattr__(name: str):
    if name == "load_detector":  # imported lazily: pipeline stages need not pay for importing MLflow
        from detectors.inference import load_detector

        return load_detector
    raise AttributeError(f"module 'detectors' has no attribute {name!r}")
