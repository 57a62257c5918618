{{/*
Names, labels and the bits every service chart shares. A service chart passes its root
context; `component` is the chart's service (catalog, runtime, effect-owner) or a
sub-component (runtime-worker, migrate).
*/}}

{{- define "nexus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nexus.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nexus.labels" -}}
{{ include "nexus.selectorLabels" . }}
app.kubernetes.io/part-of: nexus-flow
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "nexus.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "nexus.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "nexus.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the database URL: the operator's, or the one this chart makes. */}}
{{- define "nexus.dbSecretName" -}}
{{- if .Values.database.existingSecret -}}
{{- .Values.database.existingSecret -}}
{{- else -}}
{{- printf "%s-db" (include "nexus.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Trusted issuer keys: the operator's Secret, default <release>-nexus-trusted-keys. */}}
{{- define "nexus.trustedKeysSecret" -}}
{{- default (printf "%s-nexus-trusted-keys" .Release.Name) .Values.auth.trustedKeys.existingSecret -}}
{{- end -}}

{{/* Signing key Secret ("" = none): the operator's, or <fullname>-signing-key when required. */}}
{{- define "nexus.signingKeySecret" -}}
{{- if .Values.auth.signingKey.existingSecret -}}
{{- .Values.auth.signingKey.existingSecret -}}
{{- else if .Values.auth.signingKey.required -}}
{{- printf "%s-signing-key" (include "nexus.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by the server, worker and migration containers. */}}
{{- define "nexus.secretEnv" -}}
- name: {{ .Values.dbUrlVariable }}
  valueFrom:
    secretKeyRef:
      name: {{ include "nexus.dbSecretName" . }}
      key: {{ .Values.database.secretKey }}
{{- end -}}

{{/* Common FLOW_* settings of every service (the ConfigMap's shared part). */}}
{{- define "nexus.commonConfig" -}}
FLOW_ENV: {{ .Values.flowEnv | quote }}
FLOW_DATA_DIR: "/var/lib/nexus"
FLOW_LISTEN_HOST: "0.0.0.0"
{{ .Values.portVariable }}: {{ .Values.port | int64 | quote }}
FLOW_DB_AUTO_MIGRATE: {{ .Values.database.autoMigrate | quote }}
FLOW_DB_POOL_SIZE: {{ .Values.database.poolSize | int64 | quote }}
FLOW_AUTH_TRUSTED_KEYS: "/etc/nexus/auth/trusted/{{ .Values.auth.trustedKeys.key }}"
{{- if include "nexus.signingKeySecret" . }}
FLOW_AUTH_SIGNING_KEY: "/etc/nexus/auth/signing/{{ .Values.auth.signingKey.key }}"
{{- end }}
FLOW_AUTH_SIGNING_KEY_ID: {{ .Values.auth.signingKey.keyId | quote }}
{{- if include "nexus.signingKeySecret" . }}
{{- /* The service signs its own calls to other services with the same mounted key. */}}
FLOW_AUTH_SERVICE_KEY: "/etc/nexus/auth/signing/{{ .Values.auth.signingKey.key }}"
FLOW_AUTH_SERVICE_KEY_ID: {{ .Values.auth.signingKey.keyId | quote }}
{{- end }}
FLOW_AUTH_CLOCK_SKEW_S: {{ .Values.auth.clockSkewSeconds | int64 | quote }}
{{- if .Values.tls.enabled }}
FLOW_TLS_CERT: "/etc/nexus/tls/tls.crt"
FLOW_TLS_KEY: "/etc/nexus/tls/tls.key"
{{- if .Values.tls.clientAuth }}
FLOW_TLS_CLIENT_CA: "/etc/nexus/tls/ca.crt"
{{- end }}
{{- /* What this service dials (other services) is verified against the same CA, and under
mTLS it presents the pod certificate (FLOW_CLIENT_TLS_*). */}}
FLOW_CLIENT_TLS: "true"
FLOW_CLIENT_TLS_CA: "/etc/nexus/tls/ca.crt"
{{- if .Values.tls.clientAuth }}
FLOW_CLIENT_TLS_CERT: "/etc/nexus/tls/tls.crt"
FLOW_CLIENT_TLS_KEY: "/etc/nexus/tls/tls.key"
{{- end }}
{{- with .Values.tls.clientServerName }}
FLOW_CLIENT_TLS_SERVER_NAME: {{ . | quote }}
{{- end }}
{{- end }}
FLOW_GRPC_MAX_MESSAGE_BYTES: {{ .Values.grpc.maxMessageBytes | int64 | quote }}
FLOW_SHUTDOWN_GRACE_S: {{ .Values.grpc.shutdownGraceSeconds | int64 | quote }}
FLOW_OTEL_ENABLED: {{ .Values.otel.enabled | quote }}
{{- /* otel.consoleExport is the deprecated spelling of exporter: console. */}}
FLOW_OTEL_EXPORTER: {{ ternary "console" .Values.otel.exporter .Values.otel.consoleExport | quote }}
FLOW_OTEL_SQL: {{ .Values.otel.sqlSpans | quote }}
{{- with .Values.otel.otlp.endpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT: {{ . | quote }}
{{- end }}
OTEL_EXPORTER_OTLP_PROTOCOL: {{ .Values.otel.otlp.protocol | quote }}
{{- if .Values.metrics.enabled }}
FLOW_METRICS_PORT: {{ .Values.metrics.port | int64 | quote }}
FLOW_METRICS_STATE_MS: {{ .Values.metrics.stateIntervalMs | int64 | quote }}
FLOW_METRICS_STATE_ORGS: {{ .Values.metrics.stateOrgs | int64 | quote }}
FLOW_METRICS_COUNT_CAP: {{ .Values.metrics.countCap | int64 | quote }}
FLOW_METRICS_PROBE_WINDOW: {{ .Values.metrics.probeWindow | int64 | quote }}
{{- end }}
FLOW_LOG_LEVEL: {{ .Values.logLevel | quote }}
FLOW_EVENT_LOOP: {{ .Values.eventLoop | default "auto" | quote }}
FLOW_REQUEST_RETENTION_HOURS: {{ .Values.requestRetentionHours | int64 | quote }}
{{- range $name, $value := .Values.extraEnv }}
{{ $name }}: {{ $value | quote }}
{{- end }}
{{- end -}}

{{- define "nexus.volumes" -}}
- name: data
  emptyDir: {}
- name: trusted-keys
  secret:
    secretName: {{ include "nexus.trustedKeysSecret" . }}
{{- if include "nexus.signingKeySecret" . }}
- name: signing-key
  secret:
    secretName: {{ include "nexus.signingKeySecret" . }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
{{- end }}
{{- if and .Values.smtp .Values.smtp.passwordSecret }}
- name: smtp-password
  secret:
    secretName: {{ .Values.smtp.passwordSecret }}
{{- end }}
{{- end -}}

{{- define "nexus.volumeMounts" -}}
- name: data
  mountPath: /var/lib/nexus
- name: trusted-keys
  mountPath: /etc/nexus/auth/trusted
  readOnly: true
{{- if include "nexus.signingKeySecret" . }}
- name: signing-key
  mountPath: /etc/nexus/auth/signing
  readOnly: true
{{- end }}
{{- if and .Values.smtp .Values.smtp.passwordSecret }}
- name: smtp-password
  mountPath: /etc/nexus/smtp
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/nexus/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* gRPC health probe: the kubelet's own without TLS, the image's checker with TLS. */}}
{{- define "nexus.probe" -}}
{{- $root := index . 0 -}}
{{- $probe := index . 1 -}}
{{- if $root.Values.tls.enabled }}
exec:
  command:
    - python
    - -m
    - services.healthcheck
    - --service
    - {{ $root.Values.healthService }}
    - --tls-ca
    - /etc/nexus/tls/ca.crt
    - --tls-server-name
    - {{ default (include "nexus.fullname" $root) $root.Values.tls.serverName }}
{{- else }}
grpc:
  port: {{ $root.Values.port }}
{{- end }}
initialDelaySeconds: {{ $probe.initialDelaySeconds }}
periodSeconds: {{ $probe.periodSeconds }}
timeoutSeconds: {{ $probe.timeoutSeconds }}
failureThreshold: {{ $probe.failureThreshold }}
{{- end -}}

{{- define "nexus.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "nexus.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
