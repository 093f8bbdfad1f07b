{{- /* One Ray pod template; .group is the group's values, .gpus its GPUs per pod */ -}}
{{- define "tunefleet.rayPod" -}}
{{- $root := .root }}
metadata:
  labels:
    {{- include "tunefleet.selector" (dict "root" $root "component" "ray") | nindent 4 }}
    {{- include "tunefleet.memberLabel" $root | nindent 4 }}
    tunefleet.io/ray-node: "true"
    {{- with $root.Values.podLabels }}{{ toYaml . | nindent 4 }}{{ end }}
  {{- with $root.Values.podAnnotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "tunefleet.serviceAccountName" $root }}
  # the head's autoscaler sidecar calls the Kubernetes API (KubeRay binds its Role to this
  # ServiceAccount); other Ray pods need no token
  automountServiceAccountToken: {{ .head }}
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
        {{- with $root.Values.ray.extraEnv }}{{ toYaml . | nindent 8 }}{{ end }}
      {{- if .ports }}
      ports:
        - {name: gcs-server, containerPort: 6379, protocol: TCP}
        - {name: dashboard, containerPort: 8265, protocol: TCP}
        - {name: client, containerPort: 10001, protocol: TCP}
        - {name: serve, containerPort: {{ $root.Values.serve.port }}, protocol: TCP}
        - {name: metrics, containerPort: 8080, protocol: TCP}
      {{- end }}
      # Ray's own raylet and GCS health, as KubeRay's default probes check them
      livenessProbe:
        exec: {command: ["bash", "-c", "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"]}
        initialDelaySeconds: 30
        periodSeconds: 5
        timeoutSeconds: 2
        failureThreshold: 120
      readinessProbe:
        exec: {command: ["bash", "-c", "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"]}
        initialDelaySeconds: 10
        periodSeconds: 5
        timeoutSeconds: 2
        failureThreshold: 10
      resources:
        {{- $resources := deepCopy .group.resources }}
        {{- if .gpus }}
        {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) }}
        {{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" .gpus) ($resources.requests | default dict)) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
        # Ray writes its session files under /tmp (a volume) but also beside its own
        # installation at start; not verified read-only
        readOnlyRootFilesystem: false
        capabilities: {drop: [ALL]}
      volumeMounts:
        {{- include "tunefleet.volumeMounts" $root | nindent 8 }}
        - {name: shm, mountPath: /dev/shm}
  volumes:
    {{- include "tunefleet.volumes" $root | nindent 4 }}
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
