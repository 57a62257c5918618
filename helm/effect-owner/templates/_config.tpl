{{/* The effect owner's own settings (the shared ones are in nexus-lib's nexus.commonConfig). */}}
{{- define "effect-owner.serviceConfig" -}}
{{- end -}}
