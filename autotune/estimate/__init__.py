"""Analytic memory and speed models (no torch): what a setting costs on a card."""
