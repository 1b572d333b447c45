{{/* Names, labels and the pieces every specpool server's pod spec shares. */}}

{{- define "specpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; callers add app.kubernetes.io/component. */}}
{{- define "specpool.labels" -}}
helm.sh/chart: {{ include "specpool.chart" . }}
{{ include "specpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specpool
{{- end }}

{{- define "specpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Object names of the components. */}}
{{- define "specpool.routerName" -}}
{{- printf "%s-router" (include "specpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specpool.redisName" -}}
{{- printf "%s-redis" (include "specpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The endpoint's Service name: also the host it registers under (--advertise-host) and the host
targets are given (--spec-endpoint), so the router pairs them by the same HOST:PORT string. */}}
{{- define "specpool.specName" -}}
{{- printf "%s-spec" (include "specpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specpool.specAddress" -}}
{{- printf "%s:%v" (include "specpool.specName" .) .Values.specEndpoint.port }}
{{- end }}

{{/* true when the chart runs its own Redis. */}}
{{- define "specpool.inChartRedis" -}}
{{- if and (not .Values.redis.url) (not .Values.redis.existingSecret.name) }}true{{ end }}
{{- end }}

{{- define "specpool.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else }}
{{- printf "redis://%s:%v/0" (include "specpool.redisName" .) .Values.redis.port }}
{{- end }}
{{- end }}

{{/* Env entries every server gets: the registry URL (passed as --redis=$(SPECPOOL_REDIS_URL)) and
the pod's IP (what targets advertise to routers, and the endpoint's tensor-channel host). */}}
{{- define "specpool.commonEnv" -}}
- name: SPECPOOL_REDIS_URL
{{- if .Values.redis.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret.name }}
      key: {{ .Values.redis.existingSecret.key }}
{{- else }}
  value: {{ include "specpool.redisUrl" . | quote }}
{{- end }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* OMP_NUM_THREADS from a threads value (arg: the threads value; 0 or empty: unset). */}}
{{- define "specpool.threadsEnv" -}}
{{- if . -}}
- name: OMP_NUM_THREADS
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scraping (arg: dict "root" $ "metricsPort" N). */}}
{{- define "specpool.podAnnotations" -}}
{{- $root := .root }}
{{- if $root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .metricsPort | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with $root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* gRPC health probes (arg: dict "root" $ "port" N). */}}
{{- define "specpool.probes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  grpc:
    port: {{ .port }}
    service: liveness
  periodSeconds: {{ $p.startup.periodSeconds }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .port }}
    service: liveness
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: readiness
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end }}

{{/* Resources, with nvidia.com/gpu added to requests and limits (arg: dict "resources" R "gpu" N). */}}
{{- define "specpool.resources" -}}
{{- $r := deepCopy (default (dict) .resources) }}
{{- if .gpu }}
{{- $_ := set $r "limits" (merge (dict "nvidia.com/gpu" .gpu) (default (dict) $r.limits)) }}
{{- $_ := set $r "requests" (merge (dict "nvidia.com/gpu" .gpu) (default (dict) $r.requests)) }}
{{- end }}
{{- toYaml $r }}
{{- end }}
