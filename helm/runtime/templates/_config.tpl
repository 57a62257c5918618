{{/* The runtime's own settings (the shared ones are in nexus-lib's nexus.commonConfig). */}}
{{- define "runtime.serviceConfig" -}}
FLOW_CATALOG_TARGET: {{ default (printf "%s-catalog:50061" .Release.Name) .Values.catalogTarget | quote }}
FLOW_RUNTIME_WORKERS: {{ .Values.runtime.workers | int64 | quote }}
FLOW_RUNTIME_WORKER_PROCESSES: {{ .Values.runtime.workerProcesses | toString | quote }}
FLOW_RUNTIME_SWEEPS: {{ .Values.runtime.sweeps | quote }}
FLOW_RUNTIME_LEASE_MS: {{ .Values.runtime.leaseMs | int64 | quote }}
FLOW_RUNTIME_RETRY_BASE_MS: {{ .Values.runtime.retryBaseMs | int64 | quote }}
FLOW_RUNTIME_RETRY_MAX_MS: {{ .Values.runtime.retryMaxMs | int64 | quote }}
FLOW_RUNTIME_MAX_ATTEMPTS: {{ .Values.runtime.maxAttempts | int64 | quote }}
FLOW_RUNTIME_IDLE_MS: {{ .Values.runtime.idleMs | int64 | quote }}
FLOW_RUNTIME_SWEEP_MS: {{ .Values.runtime.sweepMs | int64 | quote }}
FLOW_RUNTIME_REAUTH_CACHE_MS: {{ .Values.runtime.reauthCacheMs | int64 | quote }}
FLOW_RUNTIME_RETENTION_DAYS: {{ .Values.runtime.retentionDays | int64 | quote }}
FLOW_RUNTIME_WAIT_SWEEP_MS: {{ .Values.runtime.waitSweepMs | int64 | quote }}
FLOW_RUNTIME_WAIT_BATCH: {{ .Values.runtime.waitBatch | int64 | quote }}
FLOW_RUNTIME_SIGNAL_KINDS: {{ join "," .Values.runtime.signalKinds | quote }}
FLOW_RUNTIME_LEGACY_SCHEDULER: {{ .Values.runtime.legacyScheduler | quote }}
FLOW_RUNTIME_PRECLAIM_WAKE: {{ .Values.runtime.preclaimWake | quote }}
{{- /* Effect owners by kind; default: every kind to the umbrella chart's effect owner. */}}
FLOW_EFFECT_OWNER_TARGETS: {{ default (printf "*=%s-effect-owner:50063" .Release.Name) .Values.effectOwnerTargets | quote }}
FLOW_OUTBOX_DISPATCHERS: {{ .Values.outbox.dispatchers | int64 | quote }}
FLOW_OUTBOX_MAX_ATTEMPTS: {{ .Values.outbox.maxAttempts | int64 | quote }}
FLOW_OUTBOX_RECONCILE_MAX_ATTEMPTS: {{ .Values.outbox.reconcileMaxAttempts | int64 | quote }}
FLOW_OUTBOX_RETRY_BASE_MS: {{ .Values.outbox.retryBaseMs | int64 | quote }}
FLOW_OUTBOX_RETRY_MAX_MS: {{ .Values.outbox.retryMaxMs | int64 | quote }}
FLOW_OUTBOX_LEASE_MS: {{ .Values.outbox.leaseMs | int64 | quote }}
FLOW_OUTBOX_IDLE_MS: {{ .Values.outbox.idleMs | int64 | quote }}
FLOW_OUTBOX_SWEEP_MS: {{ .Values.outbox.sweepMs | int64 | quote }}
{{- end -}}
