"""What this machine has: the probe and the GPU catalogue."""
