{{/* The runtime's own settings (the shared ones are in nexus-lib's nexus.commonConfig). */}}
{{- define "runtime.serviceConfig" -}}
FLOW_CATALOG_TARGET: {{ default (printf "%s-catalog:50061" .Release.Name) .Values.catalogTarget | quote }}
FLOW_RUNTIME_WORKERS: {{ .Values.runtime.workers | int64 | quote }}
FLOW_RUNTIME_SWEEPS: {{ .Values.runtime.sweeps | quote }}
FLOW_RUNTIME_LEASE_MS: {{ .Values.runtime.leaseMs | int64 | quote }}
FLOW_RUNTIME_RETRY_BASE_MS: {{ .Values.runtime.retryBaseMs | int64 | quote }}
FLOW_RUNTIME_RETRY_MAX_MS: {{ .Values.runtime.retryMaxMs | int64 | quote }}
FLOW_RUNTIME_MAX_ATTEMPTS: {{ .Values.runtime.maxAttempts | int64 | quote }}
FLOW_RUNTIME_IDLE_MS: {{ .Values.runtime.idleMs | int64 | quote }}
FLOW_RUNTIME_SWEEP_MS: {{ .Values.runtime.sweepMs | int64 | quote }}
FLOW_RUNTIME_RETENTION_DAYS: {{ .Values.runtime.retentionDays | int64 | quote }}
FLOW_RUNTIME_WAIT_SWEEP_MS: {{ .Values.runtime.waitSweepMs | int64 | quote }}
FLOW_RUNTIME_WAIT_BATCH: {{ .Values.runtime.waitBatch | int64 | quote }}
FLOW_RUNTIME_SIGNAL_KINDS: {{ join "," .Values.runtime.signalKinds | quote }}
{{- end -}}
