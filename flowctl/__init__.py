"""``flowctl``: the operator command line (auth, catalog, flow).

Each command group lives in its own module and registers itself in
:func:`flowctl.__main__.build_parser`. Commands talk to the services over gRPC with
a minted workload credential, except pure ones (``flow compile``) that call the same
functions the services call.
"""
