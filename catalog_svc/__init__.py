"""Catalog service: work bindings, Runtime metadata views and sealed capability catalogs."""
