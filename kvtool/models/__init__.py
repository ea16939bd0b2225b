"""Model loading and the forward pass."""
