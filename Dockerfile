# syntax=docker/dockerfile:1
#
# One image for the three services: `python -m catalog_svc`, `python -m runtime_svc`
# (or `python -m runtime_svc worker`), `python -m effect_owner_svc`; the Helm charts pick
# the module with the container args. Build: `make image` (IMAGE=name:tag to override).
#
# The base image is pinned by digest so a rebuild gets the same bytes. To move to a newer
# patch release, look the digest of the tag up and replace it (both stages use it):
#     docker buildx imagetools inspect python:3.11-slim-bookworm   # "Digest: sha256:…"
#     # or: skopeo inspect docker://docker.io/library/python:3.11-slim-bookworm | jq -r .Digest
# then rebuild and run `make test` against the new interpreter.
ARG PYTHON_IMAGE=docker.io/library/python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1

# --- build: generate the proto code, build a wheel, install it into /opt/nexus ------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The code generators only (grpcio-tools, mypy-protobuf), pinned by constraints.txt.
COPY pyproject.toml constraints.txt ./
RUN python -m venv /opt/codegen \
 && /opt/codegen/bin/pip install -c constraints.txt grpcio-tools mypy-protobuf
COPY protos ./protos
COPY scripts/gen_protos.py ./scripts/gen_protos.py
COPY services ./services
COPY catalog_svc ./catalog_svc
COPY runtime_svc ./runtime_svc
COPY effect_owner_svc ./effect_owner_svc
COPY flowctl ./flowctl
COPY README.md ./
RUN PATH=/opt/codegen/bin:$PATH /opt/codegen/bin/python scripts/gen_protos.py \
 && python -m venv /opt/nexus \
 && /opt/nexus/bin/pip install -c constraints.txt . \
 && /opt/nexus/bin/python -c "import catalog_svc.app, runtime_svc.app, effect_owner_svc.app"

# --- runtime: the installed venv, nothing else; runs as an unprivileged user --------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="nexus-flow-runtime" \
      org.opencontainers.image.description="Nexus Flow Runtime services (catalog, runtime, effect owner)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 nexus \
 && useradd --system --uid 10001 --gid nexus --home-dir /var/lib/nexus --create-home \
    --shell /usr/sbin/nologin nexus
COPY --from=build /opt/nexus /opt/nexus
ENV PATH=/opt/nexus/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FLOW_ENV=production \
    FLOW_LISTEN_HOST=0.0.0.0 \
    FLOW_DATA_DIR=/var/lib/nexus
WORKDIR /var/lib/nexus
USER 10001:10001
EXPOSE 50061 50062 50063
# gRPC health protocol; HEALTH_SERVICE names whose port to ask (the charts use the
# kubelet's own gRPC probe instead, or this command as an exec probe under TLS).
ENV HEALTH_SERVICE=runtime
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["sh", "-c", "exec python -m services.healthcheck --service \"$HEALTH_SERVICE\""]
ENTRYPOINT ["python", "-m"]
CMD ["runtime_svc"]
