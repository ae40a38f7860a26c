"""Models: the built-in tiny model, Hugging Face ids and local directories, presets, and the bytes of their state."""
