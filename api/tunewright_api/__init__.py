"""tunewright REST API and CLI (built on top of the training runtime and the planner)."""
