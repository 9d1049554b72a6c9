{{/*
Render-time checks for contradictions that values.schema.json cannot express: `helm install`
fails with the message instead of deploying pods that can never become ready.
*/}}

{{/* A Kubernetes quantity ("10", 10, "9500m", "64Gi", "1.5G") as a number of base units. */}}
{{- define "pdserve.quantity" -}}
{{- $q := toString . }}
{{- $units := dict "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 }}
{{- $suffix := regexFind "[A-Za-z]+$" $q }}
{{- if and $suffix (not (hasKey $units $suffix)) }}
{{- fail (printf "resource quantity %q: unknown suffix %q" $q $suffix) }}
{{- end }}
{{- mulf (float64 (trimSuffix $suffix $q)) (get $units $suffix | default 1.0) }}
{{- end }}

{{/* Fail when a container's requests exceed its limits (the API server would refuse the pod). */}}
{{- define "pdserve.checkRequests" -}}
{{- $resources := default dict .resources }}
{{- $requests := default dict $resources.requests }}
{{- $limits := default dict $resources.limits }}
{{- range $name := list "cpu" "memory" }}
{{- if and (hasKey $requests $name) (hasKey $limits $name) }}
{{- if gt (include "pdserve.quantity" (get $requests $name) | float64) (include "pdserve.quantity" (get $limits $name) | float64) }}
{{- fail (printf "%s.resources: requests.%s (%v) exceeds limits.%s (%v)" $.where $name (get $requests $name) $name (get $limits $name)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.validate" -}}
{{- $v := .Values }}
{{- $app := $v.app }}
{{- $anyGpu := false }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $v.pools $role }}
{{- $where := printf "pools.%s" $role }}
{{- if gt (int $pool.minReplicas) (int $pool.maxReplicas) }}
{{- fail (printf "%s: minReplicas (%v) exceeds maxReplicas (%v)" $where $pool.minReplicas $pool.maxReplicas) }}
{{- end }}
{{- /* gpus is per rank and a rank drives one GPU (PoolConfig refuses num_gpus other than
0 or 1 at tensor_parallel_size > 1); a replica spans GPUs through tensorParallelSize. */}}
{{- $tp := int $pool.tensorParallelSize }}
{{- if gt (int $pool.gpus) 1 }}
{{- fail (printf "%s.gpus=%v: gpus is per rank and a rank drives one GPU; set tensorParallelSize to split a replica over several GPUs (its pod then gets gpus x tensorParallelSize), or scale with maxReplicas" $where $pool.gpus) }}
{{- end }}
{{- /* One replica per pod, its ranks all on it (STRICT_PACK): the pod's GPU count is
gpus x tensorParallelSize, set by the chart; a different count given by hand would leave a
rank unplaceable or GPUs idle. */}}
{{- $podGpus := include "pdserve.podGpus" (dict "root" $ "role" $role) | int }}
{{- range $kind := list "limits" "requests" }}
{{- $given := index (default dict (index (default dict $pool.resources) $kind)) "nvidia.com/gpu" }}
{{- if and (not (kindIs "invalid" $given)) (ne (int $given) $podGpus) }}
{{- fail (printf "%s.resources.%s.nvidia.com/gpu=%v contradicts gpus x tensorParallelSize = %v x %d = %d (one replica per pod, all its ranks on it); leave it unset: the chart sets it" $where $kind $given $pool.gpus $tp $podGpus) }}
{{- end }}
{{- end }}
{{- if gt (int $pool.gpus) 0 }}
{{- $anyGpu = true }}
{{- else if or $pool.gpuProduct $pool.acceleratorType }}
{{- fail (printf "%s: gpuProduct/acceleratorType set but gpus is 0" $where) }}
{{- end }}
{{- if and $pool.gpuProduct $pool.acceleratorType }}
{{- $derived := include "pdserve.acceleratorFromProduct" $pool.gpuProduct }}
{{- if ne $derived $pool.acceleratorType }}
{{- fail (printf "%s: acceleratorType %q contradicts gpuProduct %q, whose Ray accelerator type is %q (leave acceleratorType empty to derive it)" $where $pool.acceleratorType $pool.gpuProduct $derived) }}
{{- end }}
{{- end }}
{{- $resources := default dict $pool.resources }}
{{- $cpuLimit := (default dict $resources.limits).cpu | default (default dict $resources.requests).cpu }}
{{- if not $cpuLimit }}
{{- fail (printf "%s.resources: set limits.cpu (Ray sizes the node from it; the replica needs cpus=%v)" $where $pool.cpus) }}
{{- end }}
{{- include "pdserve.checkRequests" (dict "resources" $resources "where" $where) }}
{{- if gt (float64 $pool.cpus) (include "pdserve.quantity" $cpuLimit | float64) }}
{{- fail (printf "%s.cpus=%v exceeds the pod's CPU limit %v: the replica could never be placed" $where $pool.cpus $cpuLimit) }}
{{- end }}
{{- $replicaCpus := mulf (float64 $pool.cpus) $tp }}
{{- if and (gt $tp 1) (gt $replicaCpus (include "pdserve.quantity" $cpuLimit | float64)) }}
{{- fail (printf "%s: cpus=%v per rank x tensorParallelSize=%d = %v CPUs exceeds the pod's CPU limit %v: a replica's ranks all run on its pod (STRICT_PACK), so it could never be placed; lower cpus or raise resources.limits.cpu" $where $pool.cpus $tp $replicaCpus $cpuLimit) }}
{{- end }}
{{- $appPool := default dict (index $app $role) }}
{{- range $key := list "min_replicas" "max_replicas" "tensor_parallel_size" "num_gpus" "num_cpus" "accelerator_type" "node_labels" }}
{{- if hasKey $appPool $key }}
{{- fail (printf "app.%s.%s is set by the chart from %s (the worker group must match it); set it there" $role $key $where) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq (toString ($app.policy).mode) "always_local") (gt (int $v.pools.prefill.minReplicas) 0) }}
{{- fail "app.policy.mode is always_local (no prefill replicas) but pools.prefill.minReplicas keeps idle prefill pods: set it to 0" }}
{{- end }}
{{- /* The KV hand-off moves the cache in its own dtype (AppConfig refuses this too). */}}
{{- $kvP := toString (default "auto" (default dict (default dict $app.prefill).engine).kv_cache_dtype) }}
{{- $kvD := toString (default "auto" (default dict (default dict $app.decode).engine).kv_cache_dtype) }}
{{- if and (ne $kvP $kvD) (ne (toString ($app.policy).mode) "always_local") }}
{{- fail (printf "app.prefill.engine.kv_cache_dtype=%q and app.decode.engine.kv_cache_dtype=%q differ: the KV hand-off moves the cache in its own dtype, so both pools must use the same one" $kvP $kvD) }}
{{- end }}
{{- include "pdserve.checkRequests" (dict "resources" $v.head.resources "where" "head") }}
{{- if hasKey $app "graceful_shutdown_timeout_s" }}
{{- fail "app.graceful_shutdown_timeout_s is set by the chart; set drain.timeoutSeconds" }}
{{- end }}
{{- $model := default dict $app.model }}
{{- if and (eq (toString $model.device) "cuda") (not $anyGpu) }}
{{- fail "app.model.device is cuda but no pool has GPUs (set pools.*.gpus, or device: cpu)" }}
{{- end }}
{{- if and $anyGpu (eq $v.image.variant "cpu") }}
{{- fail "image.variant is cpu but a pool has GPUs: the CPU image has no CUDA" }}
{{- end }}
{{- $storage := $v.modelStorage }}
{{- $source := include "pdserve.modelSource" . }}
{{- $given := list }}
{{- range $key := list "path" "hf_id" "uri" }}
{{- if index $model $key }}
{{- $given = append $given (printf "app.model.%s" $key) }}
{{- end }}
{{- end }}
{{- if gt (len $given) 1 }}
{{- fail (printf "%s are set together: give one model source (the chart's default sets app.model.hf_id; set it to null to use another source)" (join " and " $given)) }}
{{- end }}
{{- if eq $source "path" }}
{{- $volume := default dict $storage.volume }}
{{- if not $volume.inImage }}
{{- if not (or $volume.persistentVolumeClaim $volume.hostPath) }}
{{- fail (printf "app.model.path %q: modelStorage.volume mounts nothing there; give a persistentVolumeClaim or hostPath (or inImage: true)" $model.path) }}
{{- end }}
{{- if and $volume.persistentVolumeClaim $volume.hostPath }}
{{- fail "modelStorage.volume: give a persistentVolumeClaim or a hostPath, not both" }}
{{- end }}
{{- $mount := trimSuffix "/" (toString $volume.mountPath) }}
{{- if not (or (eq $model.path $mount) (hasPrefix (printf "%s/" $mount) $model.path)) }}
{{- fail (printf "app.model.path %q is not under modelStorage.volume.mountPath %q" $model.path $volume.mountPath) }}
{{- end }}
{{- end }}
{{- else if and $storage.volume (not (eq $source "test")) }}
{{- fail (printf "modelStorage.volume is set but app.model takes its weights from %s, not a path" $source) }}
{{- end }}
{{- if and $storage.hfTokenSecret.name (ne $source "hub") }}
{{- fail "modelStorage.hfTokenSecret is set but app.model.hf_id is not" }}
{{- end }}
{{- if and $model.cache_dir (ne (toString $model.cache_dir) $storage.cache.mountPath) }}
{{- fail (printf "app.model.cache_dir %q: the chart fetches into modelStorage.cache.mountPath %q; set that instead" $model.cache_dir $storage.cache.mountPath) }}
{{- end }}
{{- if eq $v.upgradeStrategy "NewClusterWithIncrementalUpgrade" }}
{{- if not $v.autoscaling.enabled }}
{{- fail "upgradeStrategy NewClusterWithIncrementalUpgrade needs autoscaling.enabled (KubeRay requires the autoscaler)" }}
{{- end }}
{{- if not $v.incrementalUpgrade.gatewayClassName }}
{{- fail "upgradeStrategy NewClusterWithIncrementalUpgrade needs incrementalUpgrade.gatewayClassName (a Gateway API implementation)" }}
{{- end }}
{{- if gt (int $v.incrementalUpgrade.stepSizePercent) (int $v.incrementalUpgrade.maxSurgePercent) }}
{{- fail "incrementalUpgrade.stepSizePercent must not exceed maxSurgePercent" }}
{{- end }}
{{- end }}
{{- end }}
