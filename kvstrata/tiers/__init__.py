"""Storage engines in plain Python: no Ray, no vLLM, unit-testable alone."""
