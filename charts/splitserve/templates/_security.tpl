{{/* Security wiring shared by the serving containers (docs/security.md). Secrets reach a
container only as mounted files; the environment carries their paths, which the services'
flags default to (SPLITSERVE_TLS_*, SPLITSERVE_KV_SECRET_FILE). */}}

{{- define "splitserve.tlsSecretName" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* .root, .component ("gateway", "prefill" or "decode") */}}
{{- define "splitserve.securityEnv" -}}
{{- $values := .root.Values -}}
{{- if $values.tls.enabled }}
- name: SPLITSERVE_TLS_CERT
  value: /etc/splitserve/tls/tls.crt
- name: SPLITSERVE_TLS_KEY
  value: /etc/splitserve/tls/tls.key
{{- if $values.tls.mutual }}
- name: SPLITSERVE_TLS_CA
  value: /etc/splitserve/tls/ca.crt
{{- end }}
- name: SPLITSERVE_TLS_SERVER_NAME
  value: {{ $values.tls.serverName | quote }}
{{- end }}
{{- if and (ne .component "gateway") $values.engine.kvAuth.existingSecret }}
- name: SPLITSERVE_KV_SECRET_FILE
  value: /etc/splitserve/kv-auth/{{ $values.engine.kvAuth.secretKey }}
{{- end }}
{{- end -}}

{{- define "splitserve.securityVolumeMounts" -}}
{{- $values := .root.Values -}}
{{- if $values.tls.enabled }}
- name: tls
  mountPath: /etc/splitserve/tls
  readOnly: true
{{- end }}
{{- if and (ne .component "gateway") $values.engine.kvAuth.existingSecret }}
- name: kv-auth
  mountPath: /etc/splitserve/kv-auth
  readOnly: true
{{- end }}
{{- if and (eq .component "gateway") $values.gateway.apiKeys.secretName }}
- name: api-keys
  mountPath: /etc/splitserve/api-keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.securityVolumes" -}}
{{- $values := .root.Values -}}
{{- if $values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "splitserve.tlsSecretName" .root }}
    defaultMode: 0440
{{- end }}
{{- if and (ne .component "gateway") $values.engine.kvAuth.existingSecret }}
{{- if ne $values.engine.kvTransport "tcp" }}
{{- fail "engine.kvAuth needs engine.kvTransport tcp: UCX connections are not authenticated (docs/security.md)" }}
{{- end }}
- name: kv-auth
  secret:
    secretName: {{ $values.engine.kvAuth.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $values.engine.kvAuth.secretKey }}
        path: {{ $values.engine.kvAuth.secretKey }}
{{- end }}
{{- if and (eq .component "gateway") $values.gateway.apiKeys.secretName }}
- name: api-keys
  secret:
    secretName: {{ $values.gateway.apiKeys.secretName }}
    defaultMode: 0440
    items:
      - key: {{ $values.gateway.apiKeys.secretKey }}
        path: {{ $values.gateway.apiKeys.secretKey }}
{{- end }}
{{- end -}}

{{/* Pods answer kubelet's gRPC probes on a plaintext health-only port when they serve TLS. */}}
{{- define "splitserve.worker.probePort" -}}
{{- $values := index .root.Values .component -}}
{{- if .root.Values.tls.enabled }}{{ .root.Values.tls.healthPort }}{{ else }}{{ $values.grpcPort }}{{ end -}}
{{- end -}}

{{/*
Egress every part of the release needs (networkPolicy.egress.enabled): DNS on port 53 to any
resolver, Redis (the bundled pod, or the external URL's port anywhere: its address is not a
pod of ours), and networkPolicy.egress.extraTo (an OpenTelemetry collector, say).
*/}}
{{- define "splitserve.commonEgress" -}}
- ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- if .Values.redis.enabled }}
- ports:
    - port: {{ .Values.redis.port }}
      protocol: TCP
  to:
    - podSelector:
        matchLabels:
          {{- include "splitserve.selectorLabels" (dict "root" . "component" "redis") | nindent 10 }}
{{- else }}
- ports:
    - port: {{ include "splitserve.externalRedisPort" . }}
      protocol: TCP
{{- end }}
{{- with .Values.networkPolicy.egress.extraTo }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The port of redis.external.url (redis://[user@]host[:port][/db]); 6379 when it names none.
*/}}
{{- define "splitserve.externalRedisPort" -}}
{{- $rest := regexReplaceAll "^[a-z]+://" .Values.redis.external.url "" -}}
{{- $hostPort := regexReplaceAll "/.*$" (regexReplaceAll "^.*@" $rest "") "" -}}
{{- $port := regexFind ":[0-9]+$" $hostPort | trimPrefix ":" -}}
{{- default "6379" $port -}}
{{- end }}
