{{/*
nexus.deployment: one Deployment of a service.
Params (dict): root (chart context), component (label), nameSuffix ("" or "-worker"),
replicas, args (container args after `python -m`), env (extra env entries, list),
resources, autoscaling (HPA values; replicas omitted when enabled).
*/}}
{{- define "nexus.deployment" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "nexus.fullname" $root }}{{ .nameSuffix }}
  labels:
    {{- include "nexus.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- if not .autoscaling.enabled }}
  replicas: {{ .replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "nexus.selectorLabels" $root | nindent 6 }}
      app.kubernetes.io/component: {{ .component }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  template:
    metadata:
      labels:
        {{- include "nexus.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # Roll the pods when their configuration changes.
        checksum/config: {{ include "nexus.configmap" $root | sha256sum }}
        {{- if and $v.metrics.enabled $v.metrics.podAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $v.metrics.port | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "nexus.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "nexus.podSecurityContext" $root | nindent 8 }}
      # SIGTERM flips health to NOT_SERVING, then in-flight RPCs get FLOW_SHUTDOWN_GRACE_S.
      terminationGracePeriodSeconds: {{ add $v.grpc.shutdownGraceSeconds 20 }}
      containers:
        - name: {{ .component }}
          image: {{ include "nexus.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if $v.metrics.enabled }}
            - name: metrics
              containerPort: {{ $v.metrics.port }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "nexus.fullname" $root }}
          env:
            {{- include "nexus.secretEnv" $root | nindent 12 }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          startupProbe:
            {{- include "nexus.probe" (list $root $v.probes.startup) | nindent 12 }}
          livenessProbe:
            {{- include "nexus.probe" (list $root $v.probes.liveness) | nindent 12 }}
          readinessProbe:
            {{- include "nexus.probe" (list $root $v.probes.readiness) | nindent 12 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          securityContext:
            {{- include "nexus.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "nexus.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "nexus.volumes" $root | nindent 8 }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* nexus.hpa: params root, component, nameSuffix, autoscaling. */}}
{{- define "nexus.hpa" -}}
{{- if .autoscaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "nexus.fullname" .root }}{{ .nameSuffix }}
  labels:
    {{- include "nexus.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "nexus.fullname" .root }}{{ .nameSuffix }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
{{- end -}}

{{/* nexus.pdb: params root, component, nameSuffix, pdb. */}}
{{- define "nexus.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "nexus.fullname" .root }}{{ .nameSuffix }}
  labels:
    {{- include "nexus.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- if .pdb.minAvailable }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "nexus.selectorLabels" .root | nindent 6 }}
      app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/*
nexus.migrationJob: `python -m <module> db upgrade` before install and upgrade. A hook runs
before the release's ConfigMap exists, so it carries its configuration inline.
*/}}
{{- define "nexus.migrationJob" -}}
{{- $v := .Values -}}
{{- if $v.migration.enabled }}
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ include "nexus.fullname" . }}-migrate
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
    app.kubernetes.io/component: migrate
  annotations:
    "helm.sh/hook": pre-install,pre-upgrade
    "helm.sh/hook-weight": "0"
    "helm.sh/hook-delete-policy": before-hook-creation,hook-succeeded
spec:
  backoffLimit: {{ $v.migration.backoffLimit }}
  activeDeadlineSeconds: {{ $v.migration.activeDeadlineSeconds }}
  template:
    metadata:
      labels:
        {{- include "nexus.labels" . | nindent 8 }}
        app.kubernetes.io/component: migrate
    spec:
      restartPolicy: Never
      automountServiceAccountToken: false
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "nexus.podSecurityContext" . | nindent 8 }}
      containers:
        - name: migrate
          image: {{ include "nexus.image" . | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args: [{{ $v.module | quote }}, "db", "upgrade"]
          env:
            - name: FLOW_ENV
              value: {{ $v.flowEnv | quote }}
            - name: FLOW_DATA_DIR
              value: /var/lib/nexus
            - name: FLOW_LOG_LEVEL
              value: {{ $v.logLevel | quote }}
            {{- include "nexus.secretEnv" . | nindent 12 }}
          resources:
            {{- toYaml $v.migration.resources | nindent 12 }}
          securityContext:
            {{- include "nexus.containerSecurityContext" . | nindent 12 }}
          volumeMounts:
            - name: data
              mountPath: /var/lib/nexus
      volumes:
        - name: data
          emptyDir: {}
{{- end }}
{{- end -}}


{{/*
nexus.podMonitor: a Prometheus Operator PodMonitor scraping `/metrics` of every pod of the
chart (API and worker Deployments alike).
*/}}
{{- define "nexus.podMonitor" -}}
{{- if and .Values.metrics.enabled .Values.metrics.podMonitor.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: {{ include "nexus.fullname" . }}
  labels:
    {{- include "nexus.labels" . | nindent 4 }}
    {{- with .Values.metrics.podMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "nexus.selectorLabels" . | nindent 6 }}
  podMetricsEndpoints:
    - port: metrics
      path: /metrics
      interval: {{ .Values.metrics.podMonitor.interval }}
{{- end }}
{{- end -}}
