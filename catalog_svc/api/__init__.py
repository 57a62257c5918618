"""gRPC API of the catalog service: the servicer and its proto <-> domain mapping.

Import the modules directly (``catalog_svc.api.servicer``); this package module stays
empty so that the service layer can use :mod:`catalog_svc.api.issues` without a cycle.
"""
