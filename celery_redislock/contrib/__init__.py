"""Integrations with optional dependencies (each imports its own lazily)."""
