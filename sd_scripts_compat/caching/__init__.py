"""Latent and text-encoder output caches (in memory and next to the images)."""
