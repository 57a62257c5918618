"""``python -m services.healthcheck``: ask a service for its gRPC health status; exit 0 if SERVING.

For container health checks and Kubernetes ``exec`` probes where the kubelet's built-in
gRPC probe cannot be used — it speaks plaintext only, so a server with ``FLOW_TLS_*`` needs
a client that does TLS (and presents a certificate under mTLS)::

    python -m services.healthcheck --service runtime            # 127.0.0.1:$FLOW_RUNTIME_PORT
    python -m services.healthcheck --service catalog --tls-ca /etc/nexus/tls/ca.crt \
        --tls-server-name nexus-catalog.flow.svc

The port comes from the service's configuration (``services.config``) unless ``--target``
is given. With ``--tls-ca`` the check uses TLS, and when the server requires client
certificates (``FLOW_TLS_CLIENT_CA`` set) it presents ``FLOW_TLS_CERT``/``FLOW_TLS_KEY``.
Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, timeout), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import ConfigError, ServiceName, load_config

__all__ = ["check", "main"]


def check(
    target: str,
    *,
    service: str = "",
    timeout_s: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> str:
    """The health status name of ``service`` at ``target`` (``SERVING``, ``NOT_SERVING`` …).

    Raises:
        grpc.RpcError: the server could not be asked.
    """
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (
        grpc.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__)
    parser.add_argument(
        "--service",
        choices=[s.value for s in ServiceName],
        default="runtime",
        help="whose configuration gives the port and TLS files (default runtime)",
    )
    parser.add_argument("--target", default="", help="host:port (default 127.0.0.1:<port>)")
    parser.add_argument("--name", default="", help="gRPC service name to ask about ('' = server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--tls-ca", default="", help="CA bundle PEM: check over TLS")
    parser.add_argument("--tls-server-name", default="", help="name the certificate is for")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(ServiceName(args.service))
    except ConfigError as exc:
        print(f"healthcheck: configuration: {exc}", file=sys.stderr)
        return 2
    target = args.target or f"127.0.0.1:{cfg.port}"
    credentials = None
    if args.tls_ca:
        try:
            root = Path(args.tls_ca).read_bytes()
            key = cert = None
            if cfg.tls_client_ca is not None and cfg.tls_cert and cfg.tls_key:
                key, cert = cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes()
        except OSError as exc:
            print(f"healthcheck: {exc}", file=sys.stderr)
            return 2
        credentials = grpc.ssl_channel_credentials(root, key, cert)
    try:
        status = check(
            target,
            service=args.name,
            timeout_s=args.timeout,
            credentials=credentials,
            server_name=args.tls_server_name or None,
        )
    except grpc.RpcError as exc:
        print(f"healthcheck: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
