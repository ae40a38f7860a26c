"""What a config becomes: the technique registry and the one function that resolves a run from it."""
