{{/* The catalog's own settings (the shared ones are in nexus-lib's nexus.commonConfig). */}}
{{- define "catalog.serviceConfig" -}}
{{- end -}}
