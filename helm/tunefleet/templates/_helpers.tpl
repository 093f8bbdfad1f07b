{{/* Names ------------------------------------------------------------------------ */}}
{{- define "tunefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tunefleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "tunefleet.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "tunefleet.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "tunefleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tunefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: api, controller, migrations, postgres, ray */}}
{{- define "tunefleet.selector" -}}
app.kubernetes.io/name: {{ include "tunefleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every pod of this release that may reach Ray and Serve carries this label */}}
{{- define "tunefleet.memberLabel" -}}
tunefleet.io/member: {{ .Release.Name | quote }}
{{- end }}

{{- define "tunefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tunefleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tunefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tunefleet.gpuImage" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cuda" (default .Chart.AppVersion .Values.image.tag)) .Values.image.gpuTag) }}
{{- end }}

{{/* Secrets ---------------------------------------------------------------------- */}}
{{- define "tunefleet.databaseSecret" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecret }}{{ else }}{{ include "tunefleet.fullname" . }}-database{{ end }}
{{- end }}

{{- define "tunefleet.databaseKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.secretKey }}{{ else }}url{{ end }}
{{- end }}

{{- define "tunefleet.serveSecret" -}}
{{- default (printf "%s-serve" (include "tunefleet.fullname" .)) .Values.serve.existingSecret }}
{{- end }}

{{- define "tunefleet.uiSecret" -}}
{{- default (printf "%s-ui" (include "tunefleet.fullname" .)) .Values.api.uiExistingSecret }}
{{- end }}

{{- define "tunefleet.rayTokenSecret" -}}
{{- default (printf "%s-ray-token" (include "tunefleet.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{/* A random value kept across upgrades: the one already in the Secret, if any */}}
{{- define "tunefleet.keptRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing (index $existing.data .key) }}
{{- index $existing.data .key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{/* Ray ------------------------------------------------------------------------- */}}
{{- define "tunefleet.rayCluster" -}}
{{ include "tunefleet.fullname" . }}-ray
{{- end }}

{{/* KubeRay names the head's Service <cluster>-head-svc */}}
{{- define "tunefleet.rayHead" -}}
{{ include "tunefleet.rayCluster" . }}-head-svc.{{ .Release.Namespace }}.svc.cluster.local
{{- end }}

{{- define "tunefleet.rayAddress" -}}
{{- if .Values.ray.external.address }}{{ .Values.ray.external.address }}{{ else }}{{ include "tunefleet.rayHead" . }}:6379{{ end }}
{{- end }}

{{- define "tunefleet.rayDashboard" -}}
{{- if .Values.ray.external.address }}{{ .Values.ray.external.dashboardUrl }}{{ else }}http://{{ include "tunefleet.rayHead" . }}:8265{{ end }}
{{- end }}

{{/* A custom Ray resource that every worker advertises and the head does not. Each run's
     driver asks for one unit of it (TUNEFLEET_RUN_DRIVER_RESOURCES, Ray Jobs'
     entrypoint_resources), so Ray starts drivers on workers, never on the head, whose pod
     holds the ServiceAccount token of KubeRay's autoscaler. */}}
{{- define "tunefleet.driverResource" -}}tunefleet-driver{{- end }}

{{/* The custom resources of one worker pod, as JSON: room for 100 drivers */}}
{{- define "tunefleet.workerRayResources" -}}
{{- dict (include "tunefleet.driverResource" .) 100 | toJson }}
{{- end }}

{{- define "tunefleet.runDriverResources" -}}
{{- dict (include "tunefleet.driverResource" .) 1 | toJson }}
{{- end }}

{{/* A CPU quantity as a number of CPUs: "4" -> 4, "500m" -> 0.5 (the group's limit, or its
     request where it has no limit) */}}
{{- define "tunefleet.cpuCount" -}}
{{- $q := toString (.limits.cpu | default .requests.cpu | default 0) }}
{{- if hasSuffix "m" $q }}{{ divf (trimSuffix "m" $q) 1000 }}{{ else }}{{ float64 $q }}{{ end }}
{{- end }}

{{/* TUNEFLEET_NODE_TYPES: the Ray worker groups the chart's RayCluster has, one entry per
     workerGroupSpecs item, so the controller knows what the autoscaler can add and holds
     a job no group can ever hold (JSON, built from the same values as the groups) */}}
{{- define "tunefleet.nodeTypes" -}}
{{- $resources := include "tunefleet.workerRayResources" . | fromJson }}
{{- $types := list }}
{{- with .Values.ray.cpuWorkers }}{{ if .enabled }}
{{- $type := dict "name" "cpu" "cpus" (include "tunefleet.cpuCount" .resources | float64) "gpus" 0 "resources" $resources "max_count" .maxReplicas }}
{{- with (.resources.limits | default dict).memory }}{{ $_ := set $type "memory" (toString .) }}{{ end }}
{{- $types = append $types $type }}
{{- end }}{{ end }}
{{- range .Values.ray.gpuWorkerGroups }}
{{- $type := dict "name" .name "cpus" (include "tunefleet.cpuCount" .resources | float64) "gpus" .gpus "resources" $resources "max_count" .maxReplicas }}
{{- with (.resources.limits | default dict).memory }}{{ $_ := set $type "memory" (toString .) }}{{ end }}
{{- if $.Values.ray.cpuWorkers.enabled }}{{ $_ := set $type "labels" (dict "tunefleet.io/role" "training") }}{{ end }}
{{- $types = append $types $type }}
{{- end }}
{{- toJson $types }}
{{- end }}

{{/* Serve's HTTP proxy, on the head (proxyLocation HeadOnly) */}}
{{- define "tunefleet.serveHost" -}}
{{- if .Values.ray.external.address }}{{ (split ":" .Values.ray.external.address)._0 }}{{ else }}{{ include "tunefleet.rayHead" . }}{{ end }}
{{- end }}

{{/* Artifacts --------------------------------------------------------------------- */}}
{{- define "tunefleet.artifactRoot" -}}
{{- if .Values.artifacts.s3.bucket }}
{{- printf "s3://%s/%s" .Values.artifacts.s3.bucket (.Values.artifacts.s3.prefix | trimAll "/") | trimSuffix "/" }}
{{- else }}/artifacts{{ end }}
{{- end }}

{{/* Where every TuneFleet process and Ray node finds artifacts and base models, and
     the S3 credentials (from a Secret, never a plain value) */}}
{{- define "tunefleet.storageEnv" -}}
- name: TUNEFLEET_ARTIFACT_ROOT
  value: {{ include "tunefleet.artifactRoot" . | quote }}
{{- if .Values.artifacts.s3.bucket }}
- name: TUNEFLEET_S3_ENDPOINT_URL
  value: {{ .Values.artifacts.s3.endpointUrl | quote }}
- name: TUNEFLEET_S3_REGION
  value: {{ .Values.artifacts.s3.region | quote }}
{{- if .Values.artifacts.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ .Values.artifacts.s3.existingSecret }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ .Values.artifacts.s3.existingSecret }}, key: AWS_SECRET_ACCESS_KEY}}
{{- end }}
{{- end }}
- name: TUNEFLEET_ARTIFACT_CACHE
  value: /cache/artifacts
- name: TUNEFLEET_ARTIFACT_CACHE_SIZE
  value: {{ .Values.artifacts.cacheSize | quote }}
- name: TUNEFLEET_MODEL_REGISTRY
  value: {{ .Values.models.path | quote }}
{{- end }}

{{/* What the API, the controller and the migration Job share */}}
{{- define "tunefleet.serviceEnv" -}}
- name: TUNEFLEET_DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ include "tunefleet.databaseSecret" . }}, key: {{ include "tunefleet.databaseKey" . }}}}
- name: TUNEFLEET_DATA_DIR
  value: /data
{{- with .Values.serviceMonitor.tokenSecret }}
- name: TUNEFLEET_METRICS_TOKEN
  valueFrom: {secretKeyRef: {name: {{ . }}, key: token}}
{{- end }}
{{- with .Values.outbound.allow }}
- name: TUNEFLEET_OUTBOUND_ALLOW
  value: {{ toJson . | quote }}
{{- end }}
{{ include "tunefleet.storageEnv" . }}
{{- end }}

{{- define "tunefleet.serveEnv" -}}
- name: TUNEFLEET_SERVE_HOST
  value: {{ include "tunefleet.serveHost" . | quote }}
- name: TUNEFLEET_SERVE_PORT
  value: {{ .Values.serve.port | quote }}
- name: TUNEFLEET_SERVE_SECRET
  valueFrom: {secretKeyRef: {name: {{ include "tunefleet.serveSecret" . }}, key: secret}}
- name: TUNEFLEET_RAY_DASHBOARD_URL
  value: {{ include "tunefleet.rayDashboard" . | quote }}
{{- end }}

{{- define "tunefleet.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom: {secretKeyRef: {name: {{ include "tunefleet.rayTokenSecret" . }}, key: auth_token}}
{{- end }}

{{/* A quantity of bytes as a number: "16Gi" -> 17179869184, "500M" -> 500000000 (the
     suffixes values.schema.json allows) */}}
{{- define "tunefleet.bytes" -}}
{{- $q := toString . }}
{{- $n := float64 0 }}{{- $matched := false }}
{{- range $unit, $m := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 "m" 0.001 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 }}
{{- if hasSuffix $unit $q }}{{ $n = mulf (trimSuffix $unit $q | float64) $m }}{{ $matched = true }}{{ end }}
{{- end }}
{{- if not $matched }}{{ $n = float64 $q }}{{ end }}
{{- printf "%.0f" $n }}
{{- end }}

{{/* A container's resources (dict "resources" R "root" $ "models" M), requesting its cache
     volumes as ephemeral storage, unless R names its own: the artifact cache where there
     is object storage to cache, and on Ray pods (M) the model cache where it is on. The
     scheduler places the pod where the caches fit, and the kubelet does not evict it for
     the space it was promised */}}
{{- define "tunefleet.cacheResources" -}}
{{- $resources := deepCopy (.resources | default dict) }}
{{- $values := .root.Values }}
{{- $caches := list }}
{{- if $values.artifacts.s3.bucket }}{{ $caches = append $caches $values.artifacts.cacheSize }}{{ end }}
{{- if and .models $values.models.nodeCacheSize }}{{ $caches = append $caches $values.models.nodeCacheSize }}{{ end }}
{{- if $caches }}
{{- $size := first $caches }}
{{- if gt (len $caches) 1 }}
{{- $bytes := 0 }}{{ range $caches }}{{ $bytes = add $bytes (include "tunefleet.bytes" . | int64) }}{{ end }}
{{- $size = toString $bytes }}
{{- end }}
{{- $_ := set $resources "requests" (merge ($resources.requests | default dict) (dict "ephemeral-storage" $size)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Volumes: the read-only root filesystem's writable places, artifacts and models */}}
{{- define "tunefleet.volumes" -}}
- name: tmp
  emptyDir: {}
- name: data
  emptyDir: {}
- name: cache
  emptyDir: {sizeLimit: {{ .Values.artifacts.cacheSize }}}
{{- if .Values.artifacts.existingClaim }}
- name: artifacts
  persistentVolumeClaim: {claimName: {{ .Values.artifacts.existingClaim }}}
{{- end }}
{{- if .Values.models.existingClaim }}
- name: models
  persistentVolumeClaim: {claimName: {{ .Values.models.existingClaim }}, readOnly: {{ not .Values.models.writable }}}
{{- end }}
{{- end }}

{{/* The mounts; the API passes the root merged with (dict "modelsWritable" true): only its
     pods may write the models claim, and only with models.writable */}}
{{- define "tunefleet.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: data, mountPath: /data}
- {name: cache, mountPath: /cache}
{{- if .Values.artifacts.existingClaim }}
- {name: artifacts, mountPath: /artifacts}
{{- end }}
{{- if .Values.models.existingClaim }}
- {name: models, mountPath: {{ .Values.models.path }}, readOnly: {{ not (and .Values.models.writable .modelsWritable) }}}
{{- end }}
{{- end }}

{{- define "tunefleet.podSpecCommon" -}}
serviceAccountName: {{ include "tunefleet.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
