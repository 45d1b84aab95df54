"""Sharing-ratio presets (``presets/*.yaml``) and calibrated heavy channels (``channels/*.json``)."""
