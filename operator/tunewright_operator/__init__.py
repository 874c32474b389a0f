"""tunewright's Kubernetes operator: handlers, reconcile, and the manifests it creates."""
