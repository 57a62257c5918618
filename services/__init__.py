"""Shared kernel imported by the catalog, runtime and effect-owner services.

It never imports any of the three service packages.
"""
