"""Model architectures the engine can run, and the loader that picks one from config.json."""
