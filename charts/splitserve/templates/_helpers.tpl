{{/*
Names, labels and the pieces every component's pod shares. Prefill and decode are rendered by
the role-parameterised helpers in _worker.tpl.
*/}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", e.g. demo-splitserve-decode. Takes (dict "root" $ "component" "x"). */}}
{{- define "splitserve.componentName" -}}
{{- printf "%s-%s" (include "splitserve.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component. Takes (dict "root" $ "component" "x"). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. Takes (dict "root" $ "component" "x"). */}}
{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" .root }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Redis URL without its password (that comes from REDIS_PASSWORD). */}}
{{- define "splitserve.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.tls -}}
{{- if not .Values.tls.enabled -}}
{{- fail "redis.tls needs tls.enabled: the bundled Redis presents the chart's certificate" -}}
{{- end -}}
{{- $files := "ssl_ca_certs=/etc/splitserve/tls/ca.crt" -}}
{{- if .Values.tls.mutual -}}
{{- $files = printf "%s&ssl_certfile=/etc/splitserve/tls/tls.crt&ssl_keyfile=/etc/splitserve/tls/tls.key" $files -}}
{{- end -}}
{{- printf "rediss://%s:%d/0?%s" (include "splitserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) $files -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s:%d/0" (include "splitserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) -}}
{{- else if .Values.redis.external.url -}}
{{- .Values.redis.external.url -}}
{{- else -}}
{{- fail "redis.enabled is false: set redis.external.url to your Redis (redis://host:6379/0)" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.engineConfigName" -}}
{{- include "splitserve.componentName" (dict "root" . "component" "engine") -}}
{{- end -}}

{{/* The model's path inside the container, empty for the image's shipped model. */}}
{{- define "splitserve.modelPath" -}}
{{- $model := .Values.model -}}
{{- if eq $model.source "pvc" -}}
{{- if not $model.pvc.claimName -}}
{{- fail "model.source is pvc: set model.pvc.claimName" -}}
{{- end -}}
{{- trimSuffix "/" (printf "%s/%s" $model.pvc.mountPath $model.path) -}}
{{- else -}}
{{- $model.path -}}
{{- end -}}
{{- end -}}

{{/* --model and --model-name from the engine ConfigMap, each only when it has a value. */}}
{{- define "splitserve.modelArgs" -}}
{{- if include "splitserve.modelPath" . }}
- --model
- $(SPLITSERVE_MODEL)
{{- end }}
{{- if .Values.model.name }}
- --model-name
- $(SPLITSERVE_MODEL_NAME)
{{- end }}
{{- end -}}

{{/* Environment every serving container gets: who and where it is, and Redis. */}}
{{- define "splitserve.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: REDIS_URL
  value: {{ include "splitserve.redisUrl" . | quote }}
{{- with .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.auth.secretKey }}
{{- end }}
# Caches torch and Triton write at run time: the root filesystem is read-only.
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- end -}}

{{/* The model volume mount, when the weights come from a PVC. */}}
{{- define "splitserve.modelVolumeMount" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  mountPath: {{ .Values.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* A component's spread across zones plus the constraints written in its values.
Takes (dict "root" $ "component" "x" "values" <its block>). */}}
{{- define "splitserve.topologySpreadConstraints" -}}
{{- $spread := .values.topologySpread -}}
{{- if or $spread.enabled .values.topologySpreadConstraints }}
topologySpreadConstraints:
{{- if $spread.enabled }}
  - maxSkew: {{ $spread.maxSkew }}
    topologyKey: {{ $spread.topologyKey }}
    whenUnsatisfiable: {{ $spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "splitserve.selectorLabels" . | nindent 8 }}
    # Spread each rollout's pods, not old and new ReplicaSets together.
    matchLabelKeys:
      - pod-template-hash
{{- end }}
{{- with .values.topologySpreadConstraints }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* nodeSelector, affinity and tolerations of a component. Takes its values block. */}}
{{- define "splitserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget for one component. Takes (dict "root" $ "component" "x" "values" <block>). */}}
{{- define "splitserve.podDisruptionBudget" -}}
{{- if .values.podDisruptionBudget.enabled -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "splitserve.componentName" . }}
  labels:
    {{- include "splitserve.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A ServiceMonitor scraping one component's Service. Takes (dict "root" $ "component" "x" "port" "<port name>"). */}}
{{- define "splitserve.serviceMonitor" -}}
{{- $monitor := .root.Values.metrics.serviceMonitor -}}
{{- if $monitor.enabled -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "splitserve.componentName" . }}
  labels:
    {{- include "splitserve.labels" . | nindent 4 }}
    {{- with $monitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" . | nindent 6 }}
  endpoints:
    - port: {{ .port }}
      path: /metrics
      interval: {{ $monitor.interval }}
{{- end }}
{{- end -}}

{{- define "splitserve.podSecurity" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
