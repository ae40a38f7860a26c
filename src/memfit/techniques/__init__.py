"""Memory techniques, one module each, switched on explicitly by the config."""
