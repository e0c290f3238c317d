{{/* Names: the release name, then the part. */}}
{{- define "maec.fullname" -}}
{{- if contains "maec" .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-maec" .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "maec.labels" -}}
app.kubernetes.io/name: maec
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "maec.selector" -}}
app.kubernetes.io/name: maec
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "maec.redisHost" -}}
{{- if .Values.redis.enabled -}}
{{ include "maec.fullname" . }}-redis
{{- else -}}
{{ required "redis.external.host is required when redis.enabled is false" .Values.redis.external.host }}
{{- end -}}
{{- end -}}

{{- define "maec.redisPort" -}}
{{- if .Values.redis.enabled }}6379{{ else }}{{ .Values.redis.external.port }}{{ end -}}
{{- end -}}

{{- define "maec.redisDb" -}}
{{- if .Values.redis.enabled }}0{{ else }}{{ .Values.redis.external.db }}{{ end -}}
{{- end -}}

{{/*
The Redis URL for MAEC_REDIS_URL. An external Redis's password is a variable set just
before it from its Secret, expanded by Kubernetes ($(VAR)), so it never passes through
values or the rendered manifests.
*/}}
{{- define "maec.redisEnv" -}}
{{- $scheme := ternary "rediss" "redis" (and (not .Values.redis.enabled) .Values.redis.external.tls) -}}
{{- $hostport := printf "%s:%s/%s" (include "maec.redisHost" .) (include "maec.redisPort" .) (include "maec.redisDb" .) -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret }}
- name: MAEC_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.passwordKey }}
- name: MAEC_REDIS_URL
  value: {{ printf "%s://:$(MAEC_REDIS_PASSWORD)@%s" $scheme $hostport | quote }}
{{- else }}
- name: MAEC_REDIS_URL
  value: {{ printf "%s://%s" $scheme $hostport | quote }}
{{- end }}
{{- end -}}

{{/* Every MAEC_* variable both the API and the workers read: settings and secrets. */}}
{{- define "maec.serviceEnv" -}}
{{- include "maec.redisEnv" . }}
- name: MAEC_STORAGE_BACKEND
  value: s3
{{- with .Values.s3.endpointUrl }}
- name: MAEC_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.publicEndpointUrl }}
- name: MAEC_S3_PUBLIC_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
- name: MAEC_S3_BUCKET
  value: {{ .Values.s3.bucket | quote }}
- name: MAEC_S3_REGION
  value: {{ .Values.s3.region | quote }}
- name: MAEC_S3_TRANSFER_CONCURRENCY
  value: {{ .Values.s3.transferConcurrency | quote }}
- name: MAEC_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ required "s3.existingSecret: the name of a Secret with the S3 credentials" .Values.s3.existingSecret }}
      key: {{ .Values.s3.accessKeyKey }}
- name: MAEC_S3_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: {{ .Values.s3.secretKeyKey }}
- name: MAEC_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ required "auth.existingSecret: the name of a Secret with MAEC_API_KEYS" .Values.auth.existingSecret }}
      key: {{ .Values.auth.apiKeysKey }}
{{- with .Values.auth.webhookSecretsKey }}
- name: MAEC_WEBHOOK_SECRETS
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.auth.existingSecret }}
      key: {{ . }}
{{- end }}
- name: MAEC_POOLS
  value: {{ include "maec.poolsJson" . | quote }}
- name: MAEC_HUB_ENABLED
  value: {{ .Values.settings.hubEnabled | quote }}
- name: MAEC_MAX_ATTEMPTS
  value: {{ .Values.settings.maxAttempts | quote }}
- name: MAEC_LEASE_SECONDS
  value: {{ .Values.settings.leaseSeconds | quote }}
{{- range $k, $v := .Values.settings.extraEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* One pool's time limit: its own, or the workers' default. */}}
{{- define "maec.poolTimeLimit" -}}
{{- .pool.taskTimeLimitSeconds | default .root.Values.worker.taskTimeLimitSeconds | int -}}
{{- end -}}

{{/*
MAEC_POOLS: every pool the release runs, with what one of its workers holds (GiB), for
the API's routing and the workers alike (app/settings.py PoolSpec).
*/}}
{{- define "maec.poolsJson" -}}
{{- $fields := dict "hostMemoryGib" "host_memory_gib" "gpuMemoryGib" "gpu_memory_gib" "diskGib" "disk_gib" -}}
{{- $pools := dict -}}
{{- range $pool := .Values.pools -}}
{{- $spec := dict -}}
{{- range $k, $v := ($pool.capacity | default dict) -}}
{{- $_ := set $spec (get $fields $k) $v -}}
{{- end -}}
{{- $_ := set $pools $pool.name $spec -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/* A pool's Celery queue: its name unless it says otherwise. */}}
{{- define "maec.poolQueue" -}}
{{- .queue | default .name -}}
{{- end -}}
