"""tunewright planner and Kubernetes operator."""
