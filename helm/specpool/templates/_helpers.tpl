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

{{/* Checks run once per render (router.yaml includes this): values this chart no longer takes, and
the security settings' combinations. Renders nothing. */}}
{{- define "specpool.validate" -}}
{{- if or .Values.redis.url (.Values.redis.existingSecret | default (dict)).name }}
{{- fail "redis.url and redis.existingSecret are gone: use redis.external.urlSecret {name, key} (or redis.external.url for a URL without a password); the in-chart Redis now has a password (redis.auth)" }}
{{- end }}
{{- if not (has .Values.security.tls.mode (list "generate" "certManager" "existingSecrets")) }}
{{- fail (printf "security.tls.mode must be generate, certManager or existingSecrets, not %q" (toString .Values.security.tls.mode)) }}
{{- end }}
{{- if and (not .Values.security.insecure) (eq .Values.security.tls.mode "certManager") (not .Values.security.tls.certManager.issuerRef.name) }}
{{- fail "security.tls.mode certManager needs security.tls.certManager.issuerRef.name (a CA issuer: every component's Secret must carry the same ca.crt)" }}
{{- end }}
{{- range $tenant, $tokens := (.Values.security.tokens.tenants | default (dict)) }}
{{- range (kindIs "slice" $tokens | ternary $tokens (list $tokens)) }}
{{- if and . (lt (len (toString .)) 16) }}
{{- fail (printf "security.tokens.tenants.%s: a token must have 16 characters or more (empty: the chart generates one)" $tenant) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Secret names. TLS Secrets hold ca.crt, tls.crt and tls.key (the kubernetes.io/tls layout
cert-manager writes), one per component instance (arg: dict "root" $ "role" router|endpoint|target
"name" TENANT). */}}
{{- define "specpool.tlsSecretName" -}}
{{- $tls := .root.Values.security.tls }}
{{- $fullname := include "specpool.fullname" .root }}
{{- if eq $tls.mode "existingSecrets" }}
{{- if eq .role "router" }}
{{- required "security.tls.existingSecrets.router: the router's TLS Secret" $tls.existingSecrets.router }}
{{- else if eq .role "endpoint" }}
{{- required "security.tls.existingSecrets.endpoint: the endpoint's TLS Secret" $tls.existingSecrets.endpoint }}
{{- else }}
{{- required (printf "security.tls.existingSecrets.targets.%s: tenant %s's TLS Secret" .name .name) (index ($tls.existingSecrets.targets | default (dict)) .name) }}
{{- end }}
{{- else if eq .role "router" }}
{{- printf "%s-router-tls" $fullname }}
{{- else if eq .role "endpoint" }}
{{- printf "%s-spec-tls" $fullname }}
{{- else }}
{{- printf "%s-target-%s-tls" $fullname .name }}
{{- end }}
{{- end }}

{{- define "specpool.caSecretName" -}}
{{- printf "%s-ca" (include "specpool.fullname" .) }}
{{- end }}

{{/* The router's tokens file (YAML: tenant -> token or list of tokens): Secret name and key. */}}
{{- define "specpool.tokensSecretName" -}}
{{- .Values.security.tokens.existingSecret.name | default (printf "%s-tokens" (include "specpool.fullname" .)) }}
{{- end }}

{{- define "specpool.tokensSecretKey" -}}
{{- if .Values.security.tokens.existingSecret.name }}{{ .Values.security.tokens.existingSecret.key | default "tokens.yaml" }}{{ else }}tokens.yaml{{ end }}
{{- end }}

{{/* The metrics token's Secret (empty: /metrics and /capacity need no token) and its key. */}}
{{- define "specpool.metricsTokenSecret" -}}
{{- if .Values.security.metricsToken.existingSecret.name }}
{{- .Values.security.metricsToken.existingSecret.name }}
{{- else if .Values.metrics.requireToken }}
{{- printf "%s-metrics-token" (include "specpool.fullname" .) }}
{{- end }}
{{- end }}

{{- define "specpool.metricsTokenKey" -}}
{{- if .Values.security.metricsToken.existingSecret.name }}{{ .Values.security.metricsToken.existingSecret.key | default "token" }}{{ else }}token{{ end }}
{{- end }}

{{/* true when the chart runs its own Redis (no redis.external URL given). */}}
{{- define "specpool.inChartRedis" -}}
{{- if and (not .Values.redis.external.url) (not .Values.redis.external.urlSecret.name) }}true{{ end }}
{{- end }}

{{/* The Secret that holds the in-chart Redis' redis.conf (and, unless redis.auth.existingSecret is
set, its generated password and the specpool pods' URL). */}}
{{- define "specpool.redisSecretName" -}}
{{- include "specpool.redisName" . }}
{{- end }}

{{/* The Secret and key holding the in-chart Redis' password. */}}
{{- define "specpool.redisPasswordSecret" -}}
{{- .Values.redis.auth.existingSecret.name | default (include "specpool.redisSecretName" .) }}
{{- end }}

{{- define "specpool.redisPasswordKey" -}}
{{- if .Values.redis.auth.existingSecret.name }}{{ .Values.redis.auth.existingSecret.key | default "password" }}{{ else }}password{{ end }}
{{- end }}

{{/* SPECPOOL_REDIS_URL, always from a Secret (the servers read it when no registry flag is given, so
a password never shows in a process's arguments). With redis.auth.existingSecret the URL is composed
from the password's env var (Kubernetes expands $(VAR) in env values). */}}
{{- define "specpool.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if $r.external.urlSecret.name }}
- name: SPECPOOL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.urlSecret.name }}
      key: {{ $r.external.urlSecret.key | default "url" }}
{{- else if $r.external.url }}
- name: SPECPOOL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-redis-url" (include "specpool.fullname" .) }}
      key: url
{{- else if $r.auth.existingSecret.name }}
- name: SPECPOOL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specpool.redisPasswordSecret" . }}
      key: {{ include "specpool.redisPasswordKey" . }}
- name: SPECPOOL_REDIS_URL
  value: {{ printf "redis://:$(SPECPOOL_REDIS_PASSWORD)@%s:%v/0" (include "specpool.redisName" .) $r.port | quote }}
{{- else }}
- name: SPECPOOL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "specpool.redisSecretName" . }}
      key: url
{{- end }}
{{- end }}

{{/* Env entries every server gets: the registry URL (from a Secret), the metrics token when one is
configured, and the pod's IP (what targets advertise to routers, and the endpoint's tensor-channel
host). TLS settings are set in each server's template, next to its flags. */}}
{{- define "specpool.commonEnv" -}}
{{- include "specpool.redisEnv" . }}
{{- with include "specpool.metricsTokenSecret" . }}
- name: SPECPOOL_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "specpool.metricsTokenKey" $ }}
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

{{/* HTTP probes on the metrics port, which stays plaintext and open for /livez and /readyz (the
gRPC port speaks TLS, which kubelet's gRPC probes cannot). /livez answers once the server runs,
/readyz while it takes work (arg: dict "root" $ "port" METRICS_PORT). */}}
{{- define "specpool.probes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  httpGet:
    path: /livez
    port: {{ .port }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  httpGet:
    path: /livez
    port: {{ .port }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
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
