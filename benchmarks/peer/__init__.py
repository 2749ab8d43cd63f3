"""vLLM's CPU build as a measuring stick: its own virtual environment, never a dependency."""
