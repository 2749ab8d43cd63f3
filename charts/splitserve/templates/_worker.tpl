{{/*
Prefill and decode pods: one Deployment and one Service shape, parameterised by role. Each takes
(dict "root" $ "component" "prefill"|"decode"); the role's values block is .Values.<role>.
*/}}

{{/* The engine ConfigMap key holding a per-role setting: SPLITSERVE_DECODE_MAX_NUM_BATCHED_TOKENS. */}}
{{- define "splitserve.worker.configKey" -}}
{{- printf "SPLITSERVE_%s_%s" (upper .component) .setting -}}
{{- end -}}

{{/* Flags both roles take. Settings come from the engine ConfigMap through $(VAR) references,
so the ConfigMap is the one place they are written. */}}
{{/* --num-threads: numThreads, else the whole CPUs the pod requests ("4", 4; not "500m"). */}}
{{- define "splitserve.worker.threadArgs" -}}
{{- $requested := toString (get (default dict (default dict .resources).requests) "cpu") -}}
{{- $threads := int (default 0 .numThreads) -}}
{{- if and (eq $threads 0) (regexMatch "^[0-9]+$" $requested) -}}
{{- $threads = int $requested -}}
{{- end -}}
{{- if gt $threads 0 }}
- --num-threads
- {{ $threads | quote }}
{{- end -}}
{{- end -}}

{{- define "splitserve.worker.args" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .component -}}
- --host
- 0.0.0.0
- --port
- {{ $values.grpcPort | quote }}
- --metrics-port
- {{ $values.metricsPort | quote }}
- --advertise-host
- $(POD_IP)
- --worker-id
- $(POD_NAME)
{{- include "splitserve.modelArgs" $root }}
- --dtype
- $(SPLITSERVE_DTYPE)
- --kv-transport
- $(SPLITSERVE_KV_TRANSPORT)
- --block-size
- $(SPLITSERVE_BLOCK_SIZE)
- --max-num-batched-tokens
- $({{ include "splitserve.worker.configKey" (dict "component" .component "setting" "MAX_NUM_BATCHED_TOKENS") }})
{{- if $values.kvCacheBytes }}
- --kv-cache-bytes
{{- else }}
- --kv-cache-memory-fraction
{{- end }}
- $({{ include "splitserve.worker.configKey" (dict "component" .component "setting" "KV_CACHE") }})
{{- include "splitserve.worker.offloadArgs" $values }}
- --quantization
- $({{ include "splitserve.worker.configKey" (dict "component" .component "setting" "QUANTIZATION") }})
- --kv-cache-dtype
- $(SPLITSERVE_KV_CACHE_DTYPE)
{{- with $root.Values.engine.loraModules }}
- --lora-modules
{{- range . }}
- {{ printf "%s=%s" .name .path | quote }}
{{- end }}
- --max-loras
- {{ default 1 $root.Values.engine.maxLoras | quote }}
{{- end }}
- --redis-url
- $(REDIS_URL)
{{- include "splitserve.worker.threadArgs" $values }}
{{- if gt (int (default 1 $values.tensorParallelSize)) 1 }}
- --tensor-parallel-size
- {{ $values.tensorParallelSize | quote }}
{{- end }}
{{- if gt (int (default 1 $values.pipelineParallelSize)) 1 }}
- --pipeline-parallel-size
- {{ $values.pipelineParallelSize | quote }}
{{- end }}
{{- if $values.enableExpertParallel }}
- --enable-expert-parallel
{{- end }}
{{- include "splitserve.worker.topologyArgs" $root }}
- --drain-timeout
- {{ include "splitserve.worker.drainTimeout" . | quote }}
- --log-level
- {{ $values.logLevel }}
{{- end -}}

{{/* The KV offload tiers: host memory always as the values say (auto by default), local disk
when diskBytes is set, in the kv-disk emptyDir: it outlives container restarts, so a restarted
engine finds its blocks again and republishes them (a warm restart). */}}
{{- define "splitserve.worker.offloadArgs" }}
- --kv-offload-host-bytes
- {{ .kvOffload.hostBytes | quote }}
{{- if .kvOffload.diskBytes }}
- --kv-offload-disk-dir
- /var/cache/splitserve/kv
- --kv-offload-disk-bytes
- {{ .kvOffload.diskBytes | quote }}
- --kv-offload-disk-min-hits
- {{ .kvOffload.diskMinHits | quote }}
{{- end }}
{{- end -}}

{{/* Seconds in-flight requests get after SIGTERM. Kubernetes counts the preStop sleep in
terminationGracePeriodSeconds, so both must fit in it, with time left to close the engine. */}}
{{- define "splitserve.worker.drainTimeout" -}}
{{- $values := index .root.Values .component -}}
{{- if ge (add $values.drainSeconds $values.drainTimeoutSeconds) (int $values.terminationGracePeriodSeconds) -}}
{{- fail (printf "%s: drainSeconds + drainTimeoutSeconds (%d + %d) must stay below terminationGracePeriodSeconds (%d)" .component (int $values.drainSeconds) (int $values.drainTimeoutSeconds) (int $values.terminationGracePeriodSeconds)) -}}
{{- end -}}
{{- $values.drainTimeoutSeconds -}}
{{- end -}}

{{/* Static region/zone when the values give them; otherwise the node's name, whose topology
labels the pod reads at start (services/pod/topology.py). */}}
{{- define "splitserve.worker.topologyArgs" -}}
{{- with .Values.topology.region }}
- --region
- {{ . | quote }}
{{- end }}
{{- with .Values.topology.zone }}
- --zone
- {{ . | quote }}
{{- end }}
{{- if .Values.topology.discover }}
- --node-name
- $(NODE_NAME)
{{- end }}
{{- end -}}

{{/* Flags only decode pods take. */}}
{{- define "splitserve.worker.decodeArgs" -}}
{{- $values := .root.Values.decode -}}
# Prefill pods send KV pages to this address; the pod's own IP, as its gRPC address is.
- --kv-host
- $(POD_IP)
- --kv-port
- {{ $values.kvPort | quote }}
- --local-prefill-threshold
- $(SPLITSERVE_DECODE_LOCAL_PREFILL_THRESHOLD)
- --max-remote-prefill-tokens
- $(SPLITSERVE_DECODE_MAX_REMOTE_PREFILL_TOKENS)
- --max-waiting-requests
- $(SPLITSERVE_DECODE_MAX_WAITING_REQUESTS)
{{- if $values.speculative.method }}
- --speculative-method
- $(SPLITSERVE_DECODE_SPECULATIVE_METHOD)
- --num-speculative-tokens
- $(SPLITSERVE_DECODE_NUM_SPECULATIVE_TOKENS)
{{- end }}
{{- end -}}

{{- define "splitserve.worker.ports" -}}
{{- $values := index .root.Values .component -}}
- name: grpc
  containerPort: {{ $values.grpcPort }}
  protocol: TCP
- name: metrics
  containerPort: {{ $values.metricsPort }}
  protocol: TCP
{{- if eq .component "decode" }}
- name: kv
  containerPort: {{ $values.kvPort }}
  protocol: TCP
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: health
  containerPort: {{ .root.Values.tls.healthPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Native gRPC probes against grpc.health.v1 on the pod's gRPC port. The pod answers
NOT_SERVING until its model has loaded, so the startup probe's budget is the load time. */}}
{{- define "splitserve.worker.probes" -}}
{{- $values := index .root.Values .component -}}
{{- $service := printf "splitserve.v1.%sWorker" (title .component) -}}
startupProbe:
  grpc:
    port: {{ include "splitserve.worker.probePort" . }}
    service: {{ $service }}
  periodSeconds: {{ $values.startupProbe.periodSeconds }}
  failureThreshold: {{ $values.startupProbe.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ include "splitserve.worker.probePort" . }}
    service: {{ $service }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ include "splitserve.worker.probePort" . }}
    service: {{ $service }}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
{{- end -}}

{{- define "splitserve.worker.resources" -}}
{{- $values := index .root.Values .component -}}
{{- $resources := deepCopy (default dict $values.resources) -}}
{{- if gt (int $values.gpus) 0 -}}
{{- $limits := default dict $resources.limits -}}
{{/* gpus is per rank: a pod of tensorParallelSize x pipelineParallelSize ranks asks for
that many times as many. */}}
{{- $ranks := mul (int (default 1 $values.tensorParallelSize)) (int (default 1 $values.pipelineParallelSize)) -}}
{{- $gpus := mul (int $values.gpus) $ranks -}}
{{- $_ := set $limits .root.Values.gpuResourceName $gpus -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- with $resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "splitserve.worker.deployment" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "splitserve.componentName" . }}
  labels:
    {{- include "splitserve.labels" . | nindent 4 }}
    splitserve.io/role: {{ .component }}
spec:
  {{- if not $root.Values.autoscaler.enabled }}
  replicas: {{ $values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" . | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      # GPUs are scarce: never ask for one more pod than there are.
      maxSurge: 0
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "splitserve.selectorLabels" . | nindent 8 }}
        splitserve.io/role: {{ .component }}
      annotations:
        checksum/engine-config: {{ include (print $root.Template.BasePath "/engine-configmap.yaml") $root | sha256sum }}
        {{- with $values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "splitserve.serviceAccountName" $root }}
      terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
      {{- with include "splitserve.podSecurity" $root | trim }}{{ . | nindent 6 }}{{ end }}
      {{- with include "splitserve.scheduling" $values | trim }}{{ . | nindent 6 }}{{ end }}
      {{- with include "splitserve.topologySpreadConstraints" (dict "root" $root "component" .component "values" $values) | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ .component }}
          image: {{ include "splitserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "-m", "splitserve.{{ .component }}"]
          args:
            {{- include "splitserve.worker.args" . | nindent 12 }}
            {{- if eq .component "decode" }}
            {{- include "splitserve.worker.decodeArgs" . | nindent 12 }}
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - --health-port
            - {{ $root.Values.tls.healthPort | quote }}
            {{- end }}
            {{- with $values.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "splitserve.engineConfigName" $root }}
          env:
            {{- include "splitserve.commonEnv" $root | nindent 12 }}
            {{- with include "splitserve.securityEnv" (dict "root" $root "component" .component) | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- include "splitserve.worker.ports" . | nindent 12 }}
          {{- include "splitserve.worker.probes" . | nindent 10 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $values.drainSeconds }}
          {{- with include "splitserve.worker.resources" . | trim }}{{ . | nindent 10 }}{{ end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: shm
              mountPath: /dev/shm
            {{- if $values.kvOffload.diskBytes }}
            - name: kv-disk
              mountPath: /var/cache/splitserve/kv
            {{- end }}
            {{- with include "splitserve.modelVolumeMount" $root | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with include "splitserve.securityVolumeMounts" (dict "root" $root "component" .component) | trim }}{{ . | nindent 12 }}{{ end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $values.sharedMemory }}
        {{- if $values.kvOffload.diskBytes }}
        - name: kv-disk
          emptyDir:
            sizeLimit: {{ $values.kvOffload.diskBytes }}
        {{- end }}
        {{- with include "splitserve.modelVolume" $root | trim }}{{ . | nindent 8 }}{{ end }}
        {{- with include "splitserve.securityVolumes" (dict "root" $root "component" .component) | trim }}{{ . | nindent 8 }}{{ end }}
{{- end -}}

{{/* Headless: the router dials pods by the address they register in Redis; the Service gives
them DNS names and a scrape target. */}}
{{- define "splitserve.worker.service" -}}
{{- $values := index .root.Values .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "splitserve.componentName" . }}
  labels:
    {{- include "splitserve.labels" . | nindent 4 }}
    splitserve.io/role: {{ .component }}
spec:
  clusterIP: None
  selector:
    {{- include "splitserve.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.grpcPort }}
      targetPort: grpc
      protocol: TCP
    - name: metrics
      port: {{ $values.metricsPort }}
      targetPort: metrics
      protocol: TCP
    {{- if eq .component "decode" }}
    - name: kv
      port: {{ $values.kvPort }}
      targetPort: kv
      protocol: TCP
    {{- end }}
{{- end -}}
