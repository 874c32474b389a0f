"""tunewright training runtime: fine-tunes a causal LM (LoRA or full) from one GPU to FSDP, on Ray Train."""
