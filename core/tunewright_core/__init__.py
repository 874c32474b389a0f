"""tunewright's core: the FineTuneJob spec and its CRDs, the planner, the runtime-config builder, GPU pools,
names and labels, and the checks that a job can run on a cluster. Imported by the API and the operator."""
