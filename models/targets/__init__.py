"""Frozen target families; each registers a ``TargetSpec`` for the HF ``model_type`` values it loads."""
