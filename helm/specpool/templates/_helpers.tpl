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

{{/* The image: the tag `make image` (or, variant cuda, `make image-cuda`) gives it unless image.tag is set. */}}
{{- define "specpool.image" -}}
{{- $tag := printf "%s%s" .Chart.AppVersion (eq .Values.image.variant "cuda" | ternary "-cuda" "") }}
{{- printf "%s:%s" .Values.image.repository (default $tag .Values.image.tag) }}
{{- end }}

{{- define "specpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "specpool.fullname" .) }}
{{- else }}
{{- .Values.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{/* The pod-level fields every specpool pod shares (router, endpoint, targets, the test): its
ServiceAccount without a mounted token, pull Secrets, the pod security context. */}}
{{- define "specpool.podBasics" -}}
serviceAccountName: {{ include "specpool.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* A Deployment's strategy (arg: the component's strategy value); rollingUpdate only with RollingUpdate
(the API rejects it beside Recreate, and Helm's merge of values would carry the default's along). */}}
{{- define "specpool.strategy" -}}
{{- $type := .type | default "RollingUpdate" }}
type: {{ $type }}
{{- if and (eq $type "RollingUpdate") .rollingUpdate }}
rollingUpdate:
  {{- toYaml .rollingUpdate | nindent 2 }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget (arg: dict "root" $ "name" NAME "component" C "labels" (extra selector labels)
"pdb" (the component's podDisruptionBudget value)). */}}
{{- define "specpool.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "specpool.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 | toJson }}
  selector:
    matchLabels:
      {{- include "specpool.selectorLabels" .root | nindent 6 }}
      app.kubernetes.io/component: {{ .component }}
      {{- with .labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
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

{{/* Endpoint instance `index` (0 .. specEndpoint.replicas-1): its object name (Deployment, Service),
its --endpoint-id and its address (arg: dict "root" $ "index" I). Instance 0 keeps the names of a
single endpoint. */}}
{{- define "specpool.specInstanceName" -}}
{{- if eq (int .index) 0 }}
{{- include "specpool.specName" .root }}
{{- else }}
{{- printf "%s-spec-%d" (include "specpool.fullname" .root) (int .index) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "specpool.specInstanceId" -}}
{{- if eq (int .index) 0 }}{{ .root.Values.specEndpoint.name }}{{ else }}{{ printf "%s-%d" .root.Values.specEndpoint.name (int .index) }}{{ end }}
{{- end }}

{{- define "specpool.specInstanceAddress" -}}
{{- printf "%s:%v" (include "specpool.specInstanceName" .) .root.Values.specEndpoint.port }}
{{- end }}

{{/* A target tenant's object name: Deployment, Service, NetworkPolicy, PodDisruptionBudget, HPA (arg:
dict "root" $ "tenant" NAME). Cut to 63 characters: specpool.validate fails on two that meet. */}}
{{- define "specpool.targetName" -}}
{{- printf "%s-target-%s" (include "specpool.fullname" .root) .tenant | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A value of target tenant i with its source: dict "value" V "path" "targets[i].KEY" or
"targetDefaults.KEY" (arg: dict "root" $ "index" I "tenant" ENTRY "key" KEY), for messages that name
the value to change. */}}
{{- define "specpool.tenantValue" -}}
{{- if hasKey .tenant .key }}
{{- dict "value" (index .tenant .key) "path" (printf "targets[%d].%s" (int .index) .key) | toJson }}
{{- else }}
{{- dict "value" (index .root.Values.targetDefaults .key) "path" (printf "targetDefaults.%s" .key) | toJson }}
{{- end }}
{{- end }}

{{/* Checks run once per render (router.yaml includes this): values this chart no longer takes, the
security settings' combinations, and the rules across values that values.schema.json cannot state
(each message names the value to change). Renders nothing. */}}
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
{{- include "specpool.validateGrace" . }}
{{- include "specpool.validateTenants" . }}
{{- include "specpool.validateNames" . }}
{{- include "specpool.validateModels" . }}
{{- end }}

{{/* Drain inside the grace period: the kubelet kills a pod terminationGracePeriodSeconds after SIGTERM,
so a server still draining its RPCs (graceS) would be killed mid-drain. */}}
{{- define "specpool.validateGrace" -}}
{{- $r := .Values.router }}
{{- if not (lt (float64 $r.graceS) (float64 $r.terminationGracePeriodSeconds)) }}
{{- fail (printf "router.graceS (%v s) must be less than router.terminationGracePeriodSeconds (%v s): the kubelet kills the pod mid-drain" $r.graceS $r.terminationGracePeriodSeconds) }}
{{- end }}
{{- if and .Values.specEndpoint.enabled (le (float64 .Values.specEndpoint.terminationGracePeriodSeconds) 10.0) }}
{{- fail (printf "specEndpoint.terminationGracePeriodSeconds (%v s) must exceed the endpoint's 10 s drain: the kubelet kills the pod mid-drain" .Values.specEndpoint.terminationGracePeriodSeconds) }}
{{- end }}
{{- range $i, $tenant := .Values.targets }}
{{- $grace := include "specpool.tenantValue" (dict "root" $ "index" $i "tenant" $tenant "key" "graceS") | fromJson }}
{{- $term := include "specpool.tenantValue" (dict "root" $ "index" $i "tenant" $tenant "key" "terminationGracePeriodSeconds") | fromJson }}
{{- if not (lt (float64 $grace.value) (float64 $term.value)) }}
{{- fail (printf "%s (%v s) must be less than %s (%v s) for tenant %s: the kubelet kills the pod mid-drain" $grace.path $grace.value $term.path $term.value (toString $tenant.tenant)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Values that name tenants or endpoint instances name ones that exist. */}}
{{- define "specpool.validateTenants" -}}
{{- $targets := list }}
{{- range .Values.targets }}
{{- $targets = append $targets (toString .tenant) }}
{{- end }}
{{- /* The tenants requests lease draft slots as: with tokens, the tenant a caller's token names (unknown
with an existing tokens Secret: not checked); with security.insecure, the placed target's tenant. */ -}}
{{- $lessees := list }}
{{- $from := "" }}
{{- if .Values.security.insecure }}
{{- $lessees = $targets }}
{{- $from = "with security.insecure a request leases as its target's tenant (targets[].tenant)" }}
{{- else if not .Values.security.tokens.existingSecret.name }}
{{- $lessees = keys (.Values.security.tokens.tenants | default (dict "default" "")) | sortAlpha }}
{{- $from = "a request leases as the tenant its bearer token names (security.tokens.tenants; none given: one token, for tenant default)" }}
{{- end }}
{{- if $from }}
{{- range $tenant, $_ := .Values.router.tenantWeights }}
{{- if not (has $tenant $lessees) }}
{{- fail (printf "router.tenantWeights.%s: there is no tenant %s: %s, and the tenants are %s" $tenant $tenant $from (join ", " $lessees)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $replicas := int .Values.specEndpoint.replicas }}
{{- range $i, $tenant := .Values.targets }}
{{- $at := include "specpool.tenantValue" (dict "root" $ "index" $i "tenant" $tenant "key" "endpointIndex") | fromJson }}
{{- if and (not (kindIs "invalid" $at.value)) (ge (int $at.value) $replicas) }}
{{- fail (printf "%s: %v for tenant %s, but there are specEndpoint.replicas = %d endpoint instances (0 .. %d)" $at.path $at.value (toString $tenant.tenant) $replicas (sub $replicas 1)) }}
{{- end }}
{{- $hpa := include "specpool.tenantValue" (dict "root" $ "index" $i "tenant" $tenant "key" "autoscaling") | fromJson }}
{{- if and $hpa.value.enabled (gt (int $hpa.value.minReplicas) (int $hpa.value.maxReplicas)) }}
{{- fail (printf "%s: minReplicas %v exceeds maxReplicas %v for tenant %s" $hpa.path $hpa.value.minReplicas $hpa.value.maxReplicas (toString $tenant.tenant)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Object names are cut to 63 characters (DNS labels): two components whose names meet after the cut
would overwrite each other's Deployment and Service. */}}
{{- define "specpool.validateNames" -}}
{{- $owners := dict }}
{{- $named := list (list (include "specpool.routerName" .) "the router") }}
{{- if include "specpool.inChartRedis" . }}
{{- $named = append $named (list (include "specpool.redisName" .) "the in-chart Redis") }}
{{- end }}
{{- if .Values.specEndpoint.enabled }}
{{- range $i := until (int .Values.specEndpoint.replicas) }}
{{- $named = append $named (list (include "specpool.specInstanceName" (dict "root" $ "index" $i)) (printf "endpoint instance %d (specEndpoint.replicas)" $i)) }}
{{- end }}
{{- end }}
{{- range $i, $tenant := .Values.targets }}
{{- $named = append $named (list (include "specpool.targetName" (dict "root" $ "tenant" $tenant.tenant)) (printf "targets[%d].tenant (%s)" $i (toString $tenant.tenant))) }}
{{- end }}
{{- range $named }}
{{- $name := index . 0 }}
{{- if hasKey $owners $name }}
{{- fail (printf "%s and %s both get the object name %s (names are cut to 63 characters): shorten one, or nameOverride / fullnameOverride" (index $owners $name) (index . 1) $name) }}
{{- end }}
{{- $_ := set $owners $name (index . 1) }}
{{- end }}
{{- end }}

{{/* Secret names. TLS Secrets hold ca.crt, tls.crt and tls.key (the kubernetes.io/tls layout
cert-manager writes), one per component instance (arg: dict "root" $ "role" router|endpoint|target
"name" TENANT). */}}
{{- define "specpool.tlsSecretName" -}}
{{- $tls := .root.Values.security.tls }}
{{- $fullname := include "specpool.fullname" .root }}
{{- $index := int (.index | default 0) }}
{{- if eq $tls.mode "existingSecrets" }}
{{- if eq .role "router" }}
{{- required "security.tls.existingSecrets.router: the router's TLS Secret" $tls.existingSecrets.router }}
{{- else if eq .role "endpoint" }}
{{- $given := $tls.existingSecrets.endpoint }}
{{- if and (kindIs "slice" $given) (lt $index (len $given)) }}
{{- required (printf "security.tls.existingSecrets.endpoint[%d]: endpoint instance %d's TLS Secret" $index $index) (index $given $index) }}
{{- else if kindIs "slice" $given }}
{{- fail (printf "security.tls.existingSecrets.endpoint: %d Secrets for specEndpoint.replicas instances; instance %d has none" (len $given) $index) }}
{{- else if eq $index 0 }}
{{- required "security.tls.existingSecrets.endpoint: the endpoint's TLS Secret" $given }}
{{- else }}
{{- fail (printf "security.tls.existingSecrets.endpoint: with specEndpoint.replicas > 1, a list of Secrets, one per instance (instance %d has none)" $index) }}
{{- end }}
{{- else }}
{{- required (printf "security.tls.existingSecrets.targets.%s: tenant %s's TLS Secret" .name .name) (index ($tls.existingSecrets.targets | default (dict)) .name) }}
{{- end }}
{{- else if eq .role "router" }}
{{- printf "%s-router-tls" $fullname }}
{{- else if eq .role "endpoint" }}
{{- printf "%s-tls" (include "specpool.specInstanceName" (dict "root" .root "index" $index)) }}
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

{{/* The metrics token's Secret and its key: existingSecret, else a generated one unless metrics.open
(then, without requireToken, none: /metrics and /capacity need no token, the servers get --metrics-open). */}}
{{- define "specpool.metricsTokenSecret" -}}
{{- if .Values.security.metricsToken.existingSecret.name }}
{{- .Values.security.metricsToken.existingSecret.name }}
{{- else if or .Values.metrics.requireToken (not .Values.metrics.open) }}
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
a password never shows in a process's arguments); arg: dict "root" $ "user" USER (specpool.redisUsers).
On the in-chart Redis each member logs in as its own user, with a password from the Redis Secret
(Kubernetes expands $(VAR) in env values); an external Redis's URL is given to all as it is. */}}
{{- define "specpool.redisEnv" -}}
{{- $root := .root }}
{{- $r := $root.Values.redis }}
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
      name: {{ printf "%s-redis-url" (include "specpool.fullname" $root) }}
      key: url
{{- else }}
- name: SPECPOOL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specpool.redisSecretName" $root }}
      key: {{ printf "user-%s" .user }}
- name: SPECPOOL_REDIS_URL
  value: {{ printf "redis://%s:$(SPECPOOL_REDIS_PASSWORD)@%s:%v/0" .user (include "specpool.redisName" $root) $r.port | quote }}
{{- end }}
{{- end }}

{{/* The in-chart Redis' users, one per member (YAML: user -> ACL rules), the rules exactly as
specpool.common.registry_schema.member_acl writes them (tests/helm checks that): a target tenant's user
writes only its tenant's records, an endpoint instance's only its own record, the routers' reads
every record and runs the lease scripts. Tenants and endpoint ids are DNS labels: no glob
character, nothing to quote. */}}
{{- define "specpool.redisUsers" -}}
{{- $member := "resetkeys ~specpool:%s nocommands +multi +exec +discard +del +hset +pexpire +ping" }}
{{- $users := dict "router" "resetkeys ~specpool:* nocommands +ping +scan +hmget +evalsha +script|load +time +zrangebyscore +zremrangebyscore +zscore +zadd +zrem +hdel +hset +hvals +pttl +pexpire" }}
{{- if .Values.specEndpoint.enabled }}
{{- range $i := until (int .Values.specEndpoint.replicas) }}
{{- $id := include "specpool.specInstanceId" (dict "root" $ "index" $i) }}
{{- $_ := set $users (printf "endpoint-%s" $id) (printf $member (printf "endpoint:%s" $id)) }}
{{- end }}
{{- end }}
{{- range .Values.targets }}
{{- $_ := set $users (printf "target-%s" .tenant) (printf $member (printf "target:%s:*" .tenant)) }}
{{- end }}
{{- toYaml $users }}
{{- end }}

{{/* Env entries every server gets (arg: dict "root" $ "user" its Redis user): the registry URL (from a
Secret), the metrics token when one is configured, and the pod's IP (what targets advertise to routers,
and the endpoint's tensor-channel host). TLS settings are set in each server's template, next to its
flags. */}}
{{- define "specpool.commonEnv" -}}
{{- include "specpool.redisEnv" . }}
{{- with include "specpool.metricsTokenSecret" .root }}
- name: SPECPOOL_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "specpool.metricsTokenKey" $.root }}
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

{{/* Pod annotations: Prometheus scraping (arg: dict "root" $ "metricsPort" N), only where /metrics
needs no token (metrics.open): an annotation-based scrape cannot send one. */}}
{{- define "specpool.podAnnotations" -}}
{{- $root := .root }}
{{- if and $root.Values.metrics.podAnnotations (not (include "specpool.metricsTokenSecret" $root)) }}
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

{{/* Resources, with the GPUs added to requests and limits (arg: dict "resources" R "gpu" N
"gpuResource" NAME; NAME default nvidia.com/gpu). */}}
{{- define "specpool.resources" -}}
{{- $r := deepCopy (default (dict) .resources) }}
{{- $gpu := .gpuResource | default "nvidia.com/gpu" }}
{{- if .gpu }}
{{- $_ := set $r "limits" (merge (dict $gpu .gpu) (default (dict) $r.limits)) }}
{{- $_ := set $r "requests" (merge (dict $gpu .gpu) (default (dict) $r.requests)) }}
{{- end }}
{{- toYaml $r }}
{{- end }}

{{/* /dev/shm as an in-memory emptyDir (arg: the shmSize value; empty: nothing): the volume, and the
mount (specpool.shmMount). NCCL's intra-node transport lives there; runtimes give 64Mi by default. */}}
{{- define "specpool.shmVolume" -}}
{{- if . }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end }}
{{- end }}

{{- define "specpool.shmMount" -}}
{{- if . }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* Model files from outside the image (.Values.models), read-only at models.mountPath in the endpoint and
every target: a PersistentVolumeClaim, a hostPath, or an emptyDir an init container fills by copying a
directory out of a model image. Each define renders nothing when models.source is "". */}}
{{- define "specpool.validateModels" -}}
{{- $m := .Values.models }}
{{- if not (has $m.source (list "" "pvc" "hostPath" "image")) }}
{{- fail (printf "models.source must be \"\", pvc, hostPath or image, not %q" (toString $m.source)) }}
{{- end }}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) }}
{{- fail "models.source pvc needs models.pvc.claimName (an existing PersistentVolumeClaim holding the model files)" }}
{{- end }}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) }}
{{- fail "models.source hostPath needs models.hostPath.path (the directory on each node that holds the model files)" }}
{{- end }}
{{- if and (eq $m.source "image") (not $m.image.repository) }}
{{- fail "models.source image needs models.image.repository (an image whose models.image.path holds the model files)" }}
{{- end }}
{{- end }}

{{- define "specpool.modelsMount" -}}
{{- $m := .Values.models }}
{{- if $m.source }}
- name: models
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "specpool.modelsVolume" -}}
{{- $m := .Values.models }}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "image" }}
- name: models
  emptyDir:
    {{- with $m.image.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{/* The init container of models.source image: copies models.image.path (its contents) into the emptyDir,
as the pod's unprivileged user; the model image needs a `cp`. */}}
{{- define "specpool.modelsInit" -}}
{{- $m := .Values.models }}
{{- if eq $m.source "image" }}
initContainers:
  - name: copy-models
    image: {{ printf "%s:%s" $m.image.repository ($m.image.tag | default "latest") | quote }}
    imagePullPolicy: {{ $m.image.pullPolicy }}
    command: ["cp", "-R", {{ printf "%s/." (trimSuffix "/" $m.image.path) | quote }}, "/models-copy/"]
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      {{- toYaml $m.image.resources | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /models-copy
{{- end }}
{{- end }}
