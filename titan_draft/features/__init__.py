"""Where a training step's ``TargetFeatures`` come from: the frozen target run online, a feature cache read
offline, or synthetic features for benchmarks."""
