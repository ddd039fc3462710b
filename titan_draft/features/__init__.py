"""Where a training step's ``TargetFeatures`` come from: the frozen target run online (``target.py``,
``graphed_capture.py``), a feature cache read offline (``offline.py``) or synthetic features for
benchmarks (``synthetic.py``); ``builder.py`` decides which, once per run."""
