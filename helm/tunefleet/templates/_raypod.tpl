{{- /* One Ray pod template; .group is the group's values, .gpus its GPUs per pod */ -}}
{{- define "tunefleet.rayPod" -}}
{{- $root := .root }}
{{- $grace := int $root.Values.ray.terminationGracePeriodSeconds }}
{{- /* Ray's own health, as KubeRay's default probes check it: the raylet through the
       node's dashboard agent, and on the head the GCS through the dashboard as well */}}
{{- $health := "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success" }}
{{- if .head }}
{{- $health = printf "%s && wget -T 10 -q -O- http://localhost:8265/api/gcs_healthz | grep success" $health }}
{{- end }}
metadata:
  labels:
    {{- include "tunefleet.selector" (dict "root" $root "component" "ray") | nindent 4 }}
    {{- include "tunefleet.memberLabel" $root | nindent 4 }}
    tunefleet.io/ray-node: "true"
    tunefleet.io/ray-role: {{ ternary "head" "worker" .head }}
    {{- with $root.Values.podLabels }}{{ toYaml . | nindent 4 }}{{ end }}
  {{- with $root.Values.podAnnotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "tunefleet.serviceAccountName" $root }}
  # the head's autoscaler sidecar calls the Kubernetes API (KubeRay binds its Role to this
  # ServiceAccount); other Ray pods need no token
  automountServiceAccountToken: {{ .head }}
  terminationGracePeriodSeconds: {{ $grace }}
  securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $root.Values.image.pullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ if .gpus }}{{ include "tunefleet.gpuImage" $root }}{{ else }}{{ include "tunefleet.image" $root }}{{ end }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      # RAY_AUTH_MODE and RAY_AUTH_TOKEN: set by KubeRay from spec.authOptions
      env:
        {{- include "tunefleet.storageEnv" $root | nindent 8 }}
        - name: TUNEFLEET_DATA_DIR
          value: /data
        {{- with $root.Values.models.nodeCacheSize }}
        # replicas and training workers load base models from this node's copy
        - name: TUNEFLEET_MODEL_CACHE
          value: /model-cache/models
        - name: TUNEFLEET_MODEL_CACHE_SIZE
          value: {{ . | quote }}
        {{- end }}
        {{- with $root.Values.ray.extraEnv }}{{ toYaml . | nindent 8 }}{{ end }}
      {{- if .ports }}
      ports:
        - {name: gcs-server, containerPort: 6379, protocol: TCP}
        - {name: dashboard, containerPort: 8265, protocol: TCP}
        - {name: client, containerPort: 10001, protocol: TCP}
        - {name: serve, containerPort: {{ $root.Values.serve.port }}, protocol: TCP}
        - {name: metrics, containerPort: 8080, protocol: TCP}
      {{- end }}
      # KubeRay's own probes and timings (5 s on the head, which asks two endpoints)
      livenessProbe:
        exec: {command: ["bash", "-c", {{ $health | quote }}]}
        initialDelaySeconds: 30
        periodSeconds: 5
        timeoutSeconds: {{ if .head }}5{{ else }}2{{ end }}
        failureThreshold: 120
      readinessProbe:
        exec: {command: ["bash", "-c", {{ $health | quote }}]}
        initialDelaySeconds: 10
        periodSeconds: 5
        timeoutSeconds: {{ if .head }}5{{ else }}2{{ end }}
        failureThreshold: 10
      # A pod told to stop (a spot VM's graceful shutdown, a scale-down, an upgrade's
      # Recreate) turns that into a Ray drain notice before Kubernetes sends SIGTERM.
      lifecycle:
        preStop:
          exec:
            command:
              - bash
              - -c
              {{- if .head }}
              # The head is not drained (a drained idle raylet exits at once): it keeps
              # the GCS up while the workers' drains, sent to it, run their course, as in
              # an upgrade, which stops every pod at once.
              - wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep -q success && sleep {{ sub $grace 10 }}
              {{- else }}
              # Drain this node (ray drain-node's default, the node of this pod; the GCS
              # from RAY_ADDRESS, which KubeRay sets): Ray schedules nothing new here, the
              # controller sees the drain and asks the run to checkpoint. Then wait for
              # the deadline; the raylet, and with it the pod, stops earlier once idle.
              # A dead raylet (a failed liveness probe) fails the drain: no wait.
              - >-
                ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
                --reason-message "pod $HOSTNAME terminating"
                --deadline-remaining-seconds {{ sub $grace 15 }}
                && sleep {{ sub $grace 15 }}
              {{- end }}
      resources:
        {{- $resources := deepCopy .group.resources }}
        {{- if .gpus }}
        {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
        {{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" .gpus) ($resources.requests | default dict)) }}
        {{- end }}
        {{- include "tunefleet.cacheResources" (dict "resources" $resources "root" $root "models" true) | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
        # Ray writes its session files under /tmp (a volume) but also beside its own
        # installation at start; not verified read-only
        readOnlyRootFilesystem: false
        capabilities: {drop: [ALL]}
      volumeMounts:
        {{- include "tunefleet.volumeMounts" $root | nindent 8 }}
        - {name: shm, mountPath: /dev/shm}
        {{- if $root.Values.models.nodeCacheSize }}
        - {name: model-cache, mountPath: /model-cache}
        {{- end }}
  volumes:
    {{- include "tunefleet.volumes" $root | nindent 4 }}
    {{- with $root.Values.models.nodeCacheSize }}
    - name: model-cache
      emptyDir: {sizeLimit: {{ . }}}
    {{- end }}
    # Ray's object store and PyTorch's DataLoader workers use shared memory
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ .group.shmSize }}}
  {{- with .group.nodeSelector }}
  nodeSelector: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations: {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
