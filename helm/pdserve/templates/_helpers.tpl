{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pdserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The Serve application's args: values.app (AppConfig fields) with each pool's replica bounds,
resources and accelerator taken from values.pools, and the front door from values.ports.
*/}}
{{- define "pdserve.appArgs" -}}
{{- $app := deepCopy .Values.app }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values.pools $role }}
{{- $sized := dict "min_replicas" (int $pool.minReplicas) "max_replicas" (int $pool.maxReplicas) "num_gpus" $pool.gpus "num_cpus" $pool.cpus }}
{{- if $pool.acceleratorType }}
{{- $_ := set $sized "accelerator_type" $pool.acceleratorType }}
{{- end }}
{{- $_ := set $app $role (mustMergeOverwrite (deepCopy (default dict (index $app $role))) $sized) }}
{{- end }}
{{- $_ := set $app "http" (mustMergeOverwrite (deepCopy (default dict $app.http)) (dict "host" "0.0.0.0" "port" (int .Values.ports.serve))) }}
{{- $_ := set $app "grpc" (dict "enabled" true "port" (int .Values.ports.grpc)) }}
{{- toYaml $app }}
{{- end }}

{{/* spec.serveConfigV2: Ray Serve's config file (ray.serve.schema.ServeDeploySchema). */}}
{{- define "pdserve.serveConfig" -}}
{{- $args := include "pdserve.appArgs" . | fromYaml }}
{{- $application := dict "name" .Values.app.name "route_prefix" (default "/" (.Values.app.http).route_prefix) "import_path" "deployments.app:build_app" "args" $args }}
{{- $grpc := dict "port" (int .Values.ports.grpc) "grpc_servicer_functions" (list "deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server") }}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" (int .Values.ports.serve)) "grpc_options" $grpc "applications" (list $application) }}
{{- toYaml $config }}
{{- end }}

{{/* Container ports every Ray pod exposes (a Serve proxy runs on every node). */}}
{{- define "pdserve.servePorts" -}}
- name: serve
  containerPort: {{ .Values.ports.serve }}
- name: serve-grpc
  containerPort: {{ .Values.ports.grpc }}
- name: metrics
  containerPort: {{ .Values.ports.metrics }}
{{- end }}

{{/* Pod volumes: /dev/shm sized for the object store and shared-memory KV, plus extras. */}}
{{- define "pdserve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .sharedMemory }}
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* One worker group: a node pool whose Ray nodes carry pdserve.io/pool=<role>. */}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values.pools $role }}
{{- $gpus := int $pool.gpus }}
- groupName: {{ $role }}
  replicas: {{ int $pool.minReplicas }}
  minReplicas: {{ int $pool.minReplicas }}
  maxReplicas: {{ int $pool.maxReplicas }}
  labels:
    pdserve.io/pool: {{ $role }}
  rayStartParams:
    metrics-export-port: {{ $root.Values.ports.metrics | quote }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        pdserve.io/pool: {{ $role }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $selector := deepCopy (default dict $pool.nodeSelector) }}
      {{- if and (gt $gpus 0) $pool.gpuProduct }}
      {{- $_ := set $selector "nvidia.com/gpu.product" $pool.gpuProduct }}
      {{- end }}
      {{- with $selector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or (gt $gpus 0) $pool.tolerations }}
      tolerations:
        {{- if gt $gpus 0 }}
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
        {{- end }}
        {{- with $pool.tolerations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- $resources := deepCopy $pool.resources }}
          {{- if gt $gpus 0 }}
          {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          ports:
            {{- include "pdserve.servePorts" $root | nindent 12 }}
          {{- with $root.Values.extraEnv }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "pdserve.volumes" (dict "root" $root "sharedMemory" $pool.sharedMemory) | nindent 8 }}
{{- end }}
