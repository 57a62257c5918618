{{/* nexus.configmap: every non-secret FLOW_* setting of the service. */}}
{{- define "nexus.configmap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "nexus.fullname" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
data:
  {{- include "nexus.commonConfig" . | nindent 2 }}
  {{- include (printf "%s.serviceConfig" .Chart.Name) . | nindent 2 }}
{{- end -}}

{{/*
nexus.dbSecret: only when the URL is given inline (development); production points
database.existingSecret at a Secret it manages (default name <fullname>-db). A hook resource, so the migration Job
(also a hook) can read it before the release's other resources exist.
*/}}
{{- define "nexus.dbSecret" -}}
{{- if and (not .Values.database.existingSecret) .Values.database.url }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ include "nexus.dbSecretName" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
  annotations:
    "helm.sh/hook": pre-install,pre-upgrade
    "helm.sh/hook-weight": "-5"
    "helm.sh/hook-delete-policy": before-hook-creation
type: Opaque
stringData:
  {{ .Values.database.secretKey }}: {{ .Values.database.url | quote }}
{{- end }}
{{- end -}}

{{- define "nexus.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "nexus.fullname" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
    app.kubernetes.io/component: {{ .Chart.Name }}
  {{- with .Values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ .Values.service.type }}
  selector:
    {{- include "nexus.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: {{ .Chart.Name }}
  ports:
    - name: grpc
      port: {{ .Values.service.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end -}}

{{- define "nexus.serviceAccount" -}}
{{- if .Values.serviceAccount.create }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "nexus.serviceAccountName" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
  {{- with .Values.serviceAccount.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: false
{{- end }}
{{- end -}}

{{/*
nexus.networkPolicy: ingress to the service's pods only from the peer components named in
.Values.networkPolicy.fromComponents (runtime->catalog, runtime->effect-owner,
effect-owner->runtime) of the same release, and from the client selectors.
*/}}
{{- define "nexus.networkPolicy" -}}
{{- if .Values.networkPolicy.enabled }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "nexus.fullname" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "nexus.selectorLabels" . | nindent 6 }}
  policyTypes: ["Ingress"]
  ingress:
    - ports:
        - port: {{ .Values.port }}
          protocol: TCP
      from:
        {{- range .Values.networkPolicy.fromComponents }}
        - podSelector:
            matchLabels:
              app.kubernetes.io/part-of: nexus-flow
              app.kubernetes.io/instance: {{ $.Release.Name }}
              app.kubernetes.io/component: {{ . }}
        {{- end }}
        {{- with .Values.networkPolicy.clients }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- if and .Values.metrics.enabled .Values.metrics.scrapers }}
    - ports:
        - port: {{ .Values.metrics.port }}
          protocol: TCP
      from:
        {{- toYaml .Values.metrics.scrapers | nindent 8 }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* nexus.testPod: `helm test` asks the service for its gRPC health status. */}}
{{- define "nexus.testPod" -}}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "nexus.fullname" . }}-test-health
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
    app.kubernetes.io/component: test
    nexus-flow/client: "true"
  annotations:
    "helm.sh/hook": test
    "helm.sh/hook-delete-policy": before-hook-creation,hook-succeeded
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  securityContext:
    {{- include "nexus.podSecurityContext" . | nindent 4 }}
  containers:
    - name: health
      image: {{ include "nexus.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - services.healthcheck
        - --service
        - {{ .Values.healthService }}
        - --target
        - {{ printf "%s:%v" (include "nexus.fullname" .) .Values.service.port }}
        {{- if .Values.tls.enabled }}
        - --tls-ca
        - /etc/nexus/tls/ca.crt
        - --tls-server-name
        - {{ default (include "nexus.fullname" .) .Values.tls.serverName }}
        {{- end }}
      {{- if and .Values.tls.enabled .Values.tls.clientAuth }}
      env:
        # mTLS: the checker presents the pod certificate, as the services do.
        - name: FLOW_TLS_CERT
          value: /etc/nexus/tls/tls.crt
        - name: FLOW_TLS_KEY
          value: /etc/nexus/tls/tls.key
        - name: FLOW_TLS_CLIENT_CA
          value: /etc/nexus/tls/ca.crt
      {{- end }}
      {{- if .Values.tls.enabled }}
      volumeMounts:
        - name: tls
          mountPath: /etc/nexus/tls
          readOnly: true
      {{- end }}
      resources:
        requests: {cpu: 50m, memory: 64Mi}
        limits: {cpu: 200m, memory: 128Mi}
      securityContext:
        {{- include "nexus.containerSecurityContext" . | nindent 8 }}
  {{- if .Values.tls.enabled }}
  volumes:
    - name: tls
      secret:
        secretName: {{ .Values.tls.secretName }}
  {{- end }}
{{- end -}}
