{{/* The effect owner's own settings (the shared ones are in nexus-lib's nexus.commonConfig). */}}
{{- define "effect-owner.serviceConfig" -}}
{{- /* Completion receipts go to the runtime; default: the umbrella chart's runtime. */}}
FLOW_EFFECT_RUNTIME_TARGET: {{ default (printf "%s-runtime:50062" .Release.Name) .Values.runtimeTarget | quote }}
FLOW_EFFECT_DISPATCHERS: {{ .Values.effects.dispatchers | int64 | quote }}
FLOW_EFFECT_PROVIDERS: {{ include "effect-owner.providers" . | quote }}
FLOW_EFFECT_MAX_ATTEMPTS: {{ .Values.effects.maxAttempts | int64 | quote }}
FLOW_EFFECT_RECONCILE_MAX_ATTEMPTS: {{ .Values.effects.reconcileMaxAttempts | int64 | quote }}
FLOW_EFFECT_RETRY_BASE_MS: {{ .Values.effects.retryBaseMs | int64 | quote }}
FLOW_EFFECT_RETRY_MAX_MS: {{ .Values.effects.retryMaxMs | int64 | quote }}
FLOW_EFFECT_LEASE_MS: {{ .Values.effects.leaseMs | int64 | quote }}
FLOW_EFFECT_PRECLAIM_COMMAND: {{ .Values.effects.preclaimCommand | quote }}
FLOW_EFFECT_IDLE_MS: {{ .Values.effects.idleMs | int64 | quote }}
FLOW_EFFECT_RECEIPT_MAX_ATTEMPTS: {{ .Values.effects.receiptMaxAttempts | int64 | quote }}
FLOW_EFFECT_SMTP_HOST: {{ .Values.smtp.host | quote }}
FLOW_EFFECT_SMTP_PORT: {{ .Values.smtp.port | int64 | quote }}
FLOW_EFFECT_SMTP_FROM: {{ .Values.smtp.from | quote }}
FLOW_EFFECT_SMTP_STARTTLS: {{ .Values.smtp.starttls | quote }}
FLOW_EFFECT_SMTP_USERNAME: {{ .Values.smtp.username | quote }}
{{- if .Values.smtp.passwordSecret }}
FLOW_EFFECT_SMTP_PASSWORD_FILE: "/etc/nexus/smtp/{{ .Values.smtp.passwordKey }}"
{{- end }}
FLOW_EFFECT_SMTP_TIMEOUT_S: {{ .Values.smtp.timeoutSeconds | int64 | quote }}
FLOW_EFFECT_WEBHOOK_URL: {{ .Values.webhook.url | quote }}
FLOW_EFFECT_WEBHOOK_STATUS_URL: {{ .Values.webhook.statusUrl | quote }}
FLOW_EFFECT_WEBHOOK_TIMEOUT_S: {{ .Values.webhook.timeoutSeconds | int64 | quote }}
FLOW_EFFECT_WEBHOOK_IDEMPOTENT: {{ .Values.webhook.idempotent | quote }}
FLOW_OUTBOX_DISPATCHERS: {{ .Values.outbox.dispatchers | int64 | quote }}
FLOW_OUTBOX_MAX_ATTEMPTS: {{ .Values.outbox.maxAttempts | int64 | quote }}
FLOW_OUTBOX_RECONCILE_MAX_ATTEMPTS: {{ .Values.outbox.reconcileMaxAttempts | int64 | quote }}
FLOW_OUTBOX_RETRY_BASE_MS: {{ .Values.outbox.retryBaseMs | int64 | quote }}
FLOW_OUTBOX_RETRY_MAX_MS: {{ .Values.outbox.retryMaxMs | int64 | quote }}
FLOW_OUTBOX_LEASE_MS: {{ .Values.outbox.leaseMs | int64 | quote }}
FLOW_OUTBOX_IDLE_MS: {{ .Values.outbox.idleMs | int64 | quote }}
FLOW_OUTBOX_SWEEP_MS: {{ .Values.outbox.sweepMs | int64 | quote }}
{{- end -}}

{{/* effects.providers as FLOW_EFFECT_PROVIDERS: kind=type,… in key order. */}}
{{- define "effect-owner.providers" -}}
{{- $out := list -}}
{{- range $kind, $type := .Values.effects.providers -}}
{{- $out = append $out (printf "%s=%s" $kind $type) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
