"""Calibration only (never imported at run time): fake-tensor memory traces and fits."""
