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

{{/* The image: the cuda variant is <repository>:<tag>, the cpu variant <tag>-cpu. */}}
{{- define "pdserve.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if eq .Values.image.variant "cpu" }}
{{- $tag = printf "%s-cpu" $tag }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
Ray's ray.io/accelerator-type for a GPU Feature Discovery product label. GFD's
nvidia.com/gpu.product is the NVML device name with spaces turned into dashes; Ray names the
GPU it finds from that NVML name (ray/_private/accelerators/nvidia_gpu.py,
_gpu_name_to_accelerator_type): the leading upper-case tokens up to the first one with a
digit ("NVIDIA H100 80GB HBM3" -> H100), else the name without "NVIDIA". The same rule here
keeps the group's label equal to what Ray sets on the node; tests/helm checks it against
Ray's function.
*/}}
{{- define "pdserve.acceleratorFromProduct" -}}
{{- $name := replace "-" " " . }}
{{- $re := `^\w+\s+((?:[A-Z]+\s+)*[A-Z0-9]*\d[A-Z0-9]*)` }}
{{- $type := "" }}
{{- if regexMatch $re $name }}
{{- $type = regexReplaceAll (printf "%s.*$" $re) $name "${1}" | replace " " "-" }}
{{- end }}
{{- if le (len $type) 1 }}
{{- $type = regexReplaceAll `^NVIDIA\s+` $name "" | trim | replace " " "-" }}
{{- end }}
{{- $type }}
{{- end }}

{{/*
A pool's accelerator type (dict "root" . "role" <pool>): acceleratorType if set, else derived
from gpuProduct; "" for a pool that takes any GPU or none. The one value behind both the
worker group's ray.io/accelerator-type label and the replicas' label_selector.
*/}}
{{- define "pdserve.accelerator" -}}
{{- $pool := index .root.Values.pools .role }}
{{- $derived := "" }}
{{- if $pool.gpuProduct }}
{{- $derived = include "pdserve.acceleratorFromProduct" $pool.gpuProduct }}
{{- end }}
{{- default $derived $pool.acceleratorType }}
{{- end }}

{{/* Which kind of model source app.model names: path | hub | uri | test. */}}
{{- define "pdserve.modelSource" -}}
{{- $model := default dict .Values.app.model }}
{{- if $model.hf_id }}hub
{{- else if $model.uri }}uri
{{- else if $model.path }}path
{{- else }}test
{{- end }}
{{- end }}

{{/*
The Serve application's args: values.app (AppConfig fields) with each pool's replica bounds,
TP size, per-rank resources and accelerator taken from values.pools, the front door from values.ports, the
model cache from values.modelStorage and the drain timeout from values.drain.
*/}}
{{- define "pdserve.appArgs" -}}
{{- $app := deepCopy .Values.app }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values.pools $role }}
{{- $sized := dict "min_replicas" (int $pool.minReplicas) "max_replicas" (int $pool.maxReplicas) "tensor_parallel_size" (int $pool.tensorParallelSize) "num_gpus" $pool.gpus "num_cpus" $pool.cpus }}
{{- $accelerator := include "pdserve.accelerator" (dict "root" $ "role" $role) }}
{{- if $accelerator }}
{{- $_ := set $sized "accelerator_type" $accelerator }}
{{- end }}
{{- $_ := set $app $role (mustMergeOverwrite (deepCopy (default dict (index $app $role))) $sized) }}
{{- end }}
{{- if has (include "pdserve.modelSource" .) (list "hub" "uri") }}
{{- $_ := set $app "model" (mustMergeOverwrite (deepCopy $app.model) (dict "cache_dir" .Values.modelStorage.cache.mountPath)) }}
{{- end }}
{{- $_ := set $app "graceful_shutdown_timeout_s" .Values.drain.timeoutSeconds }}
{{- $_ := set $app "http" (mustMergeOverwrite (deepCopy (default dict $app.http)) (dict "host" "0.0.0.0" "port" (int .Values.ports.serve))) }}
{{- $_ := set $app "grpc" (dict "enabled" true "port" (int .Values.ports.grpc)) }}
{{- toYaml $app }}
{{- end }}

{{/* spec.serveConfigV2: Ray Serve's config file (ray.serve.schema.ServeDeploySchema). */}}
{{- define "pdserve.serveConfig" -}}
{{- $args := include "pdserve.appArgs" . | fromYaml }}
{{- $application := dict "name" .Values.app.name "route_prefix" (default "/" (.Values.app.http).route_prefix) "import_path" "pdserve.deployments.app:build_app" "args" $args }}
{{- $grpc := dict "port" (int .Values.ports.grpc) "grpc_servicer_functions" (list "pdserve.deployments.grpc.pdserve_pb2_grpc.add_PDServeServicer_to_server") }}
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

{{/* Environment of every Ray container: replicas never reach the Hub themselves; Serve's
HTTP servers (proxies, direct-ingress replicas) run pdserve's EdgeGate. */}}
{{- define "pdserve.rayEnv" -}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: "pdserve.deployments.door_gate:serve_http_middlewares"
{{- if eq .Values.frontDoor "haproxy" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod volumes (dict "root" . "sharedMemory" <size>): /dev/shm sized for the object store
and shared-memory KV, the model volume or cache, plus extras. */}}
{{- define "pdserve.volumes" -}}
{{- $root := .root }}
{{- $storage := $root.Values.modelStorage }}
{{- $source := include "pdserve.modelSource" $root }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .sharedMemory }}
{{- if and (eq $source "path") (not $storage.volume.inImage) }}
- name: model
  {{- if $storage.volume.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ $storage.volume.persistentVolumeClaim.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    {{- toYaml $storage.volume.hostPath | nindent 4 }}
  {{- end }}
{{- end }}
{{- if has $source (list "hub" "uri") }}
- name: model-cache
  {{- if $storage.cache.hostPath }}
  hostPath:
    path: {{ $storage.cache.hostPath }}
    type: DirectoryOrCreate
  {{- else }}
  emptyDir:
    sizeLimit: {{ $storage.cache.sizeLimit }}
  {{- end }}
{{- end }}
{{- with $root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The Ray container's mounts: the model read-only, wherever it comes from. */}}
{{- define "pdserve.volumeMounts" -}}
{{- $storage := .Values.modelStorage }}
{{- $source := include "pdserve.modelSource" . }}
- name: dshm
  mountPath: /dev/shm
{{- if and (eq $source "path") (not $storage.volume.inImage) }}
- name: model
  mountPath: {{ $storage.volume.mountPath }}
  readOnly: true
{{- end }}
{{- if has $source (list "hub" "uri") }}
- name: model-cache
  mountPath: {{ $storage.cache.mountPath }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The init container that downloads a hub or object-store model into the cache before Ray
starts on the pod (dict "root" . "metadataOnly" <bool>): the head needs only config and
tokenizer (app builder, ingress); workers get the weights. Nothing for path/test sources.
*/}}
{{- define "pdserve.initContainers" -}}
{{- $root := .root }}
{{- $storage := $root.Values.modelStorage }}
{{- if has (include "pdserve.modelSource" $root) (list "hub" "uri") }}
{{- $model := (include "pdserve.appArgs" $root | fromYaml).model }}
{{- $args := list "python" "-m" "pdserve.deployments.model_source" "fetch" "--model" (toJson $model) }}
{{- if .metadataOnly }}
{{- $args = append $args "--metadata-only" }}
{{- end }}
initContainers:
  - name: fetch-model
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command:
      {{- toYaml $args | nindent 6 }}
    env:
      - name: HF_HUB_DISABLE_PROGRESS_BARS
        value: "1"
      {{- with $storage.hfEndpoint }}
      - name: HF_ENDPOINT
        value: {{ . | quote }}
      {{- end }}
      {{- if $storage.hfTokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ $storage.hfTokenSecret.name }}
            key: {{ $storage.hfTokenSecret.key }}
      {{- end }}
    {{- with $storage.objectStoreSecret }}
    envFrom:
      - secretRef:
          name: {{ . }}
    {{- end }}
    resources:
      {{- toYaml $storage.downloader.resources | nindent 6 }}
    {{- with $storage.downloader.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: model-cache
        mountPath: {{ $storage.cache.mountPath }}
{{- end }}
{{- end }}

{{/* GPUs on one pod of a pool (dict "root" . "role" <pool>): one replica per pod, whose
tensorParallelSize ranks take gpus each, all on that pod (STRICT_PACK). */}}
{{- define "pdserve.podGpus" -}}
{{- $pool := index .root.Values.pools .role }}
{{- mul (int $pool.gpus) (int $pool.tensorParallelSize) }}
{{- end }}

{{/* One worker group: a node pool whose Ray nodes carry pdserve.io/pool=<role> and, on
GPUs, ray.io/accelerator-type: every label the pool's replicas select on. */}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values.pools $role }}
{{- $gpus := include "pdserve.podGpus" (dict "root" $root "role" $role) | int }}
{{- $accelerator := include "pdserve.accelerator" (dict "root" $root "role" $role) }}
- groupName: {{ $role }}
  replicas: {{ int $pool.minReplicas }}
  minReplicas: {{ int $pool.minReplicas }}
  maxReplicas: {{ int $pool.maxReplicas }}
  labels:
    pdserve.io/pool: {{ $role }}
    {{- if $accelerator }}
    ray.io/accelerator-type: {{ $accelerator }}
    {{- end }}
  rayStartParams:
    metrics-export-port: {{ $root.Values.ports.metrics | quote }}
    {{- if gt $gpus 0 }}
    # The GPUs Ray schedules on the node: every rank of the pod's replica.
    num-gpus: {{ $gpus | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        pdserve.io/pool: {{ $role }}
    spec:
      terminationGracePeriodSeconds: {{ add $root.Values.drain.timeoutSeconds $root.Values.drain.extraSeconds }}
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
      {{- with include "pdserve.initContainers" (dict "root" $root "metadataOnly" false) | trim }}
      {{- . | nindent 6 }}
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
          env:
            {{- include "pdserve.rayEnv" $root | nindent 12 }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" $root | trim | nindent 12 }}
      volumes:
        {{- include "pdserve.volumes" (dict "root" $root "sharedMemory" $pool.sharedMemory) | trim | nindent 8 }}
{{- end }}
