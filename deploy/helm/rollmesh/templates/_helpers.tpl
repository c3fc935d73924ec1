{{/* Name of the release's objects: <release>-rollmesh unless the release name says rollmesh. */}}
{{- define "rollmesh.fullname" -}}
{{- if contains "rollmesh" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-rollmesh" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of one component: call with (dict "root" $ "component" "llm-proxy"). */}}
{{- define "rollmesh.selectorLabels" -}}
app.kubernetes.io/name: rollmesh
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rollmesh.labels" -}}
{{ include "rollmesh.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
{{- end -}}

{{- define "rollmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* host:port of a component's Service. */}}
{{- define "rollmesh.address" -}}
{{ include "rollmesh.fullname" .root }}-{{ .component }}:{{ .port }}
{{- end -}}

{{- define "rollmesh.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "rollmesh.fullname" . }}-redis:6379/0
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Node selector of a GPU workload ("engine" or "trainer") under placement.mode. */}}
{{- define "rollmesh.gpuNodeSelector" -}}
{{- $root := .root -}}
{{- if eq $root.Values.placement.mode "colocated" -}}
{{- toYaml $root.Values.placement.colocatedNodeSelector -}}
{{- else if eq $root.Values.placement.mode "disaggregated" -}}
{{- toYaml (index $root.Values .component).nodeSelector -}}
{{- else -}}
{{- fail (printf "placement.mode must be disaggregated or colocated, got %q" $root.Values.placement.mode) -}}
{{- end -}}
{{- end -}}

{{/* The run config every service reads: config from values, plus the mesh's addresses and paths. */}}
{{- define "rollmesh.config" -}}
{{- $name := include "rollmesh.fullname" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $scheme := ternary "https" "http" (not (empty $.Values.auth.tls.secretName)) -}}
{{- $urls = append $urls (printf "%s://%s-engine-%d.%s-engine:%d" $scheme $name $i $name (int $.Values.engine.port)) -}}
{{- end -}}
{{- $proxy := include "rollmesh.address" (dict "root" . "component" "llm-proxy" "port" .Values.proxy.port) -}}
{{- $buffer := include "rollmesh.address" (dict "root" . "component" "sample-buffer" "port" .Values.buffer.port) -}}
{{- $controller := include "rollmesh.address" (dict "root" . "component" "controller" "port" .Values.controller.port) -}}
{{- $reward := include "rollmesh.address" (dict "root" . "component" "reward" "port" .Values.reward.port) -}}
{{- $mesh := dict
  "model_path" .Values.model.path
  "mesh" (dict "proxy" $proxy "buffer" $buffer "controller" $controller "reward" $reward)
  "engine" (dict "host" "0.0.0.0" "port" .Values.engine.port)
  "proxy" (dict "engine_urls" $urls "host" "0.0.0.0" "port" .Values.proxy.port "metrics_port" .Values.proxy.metricsPort)
  "buffer" (dict "backend" "redis" "redis_url" (include "rollmesh.redisUrl" .) "key_prefix" (printf "rollmesh:%s" .Release.Name)
                 "host" "0.0.0.0" "port" .Values.buffer.port "metrics_port" .Values.buffer.metricsPort)
  "controller" (dict "host" "0.0.0.0" "port" .Values.controller.port "metrics_port" .Values.controller.metricsPort)
  "env_manager" (dict "host" "0.0.0.0" "port" .Values.envManager.port "metrics_port" .Values.envManager.metricsPort)
  "gateway" (dict "host" "0.0.0.0" "port" .Values.gateway.port)
  "reward_service" (dict "host" "0.0.0.0" "port" .Values.reward.port "metrics_port" .Values.reward.metricsPort)
  "train_loop" (dict "run_dir" (printf "%s/%s" .Values.runs.mountPath .Release.Name) "metrics_host" "0.0.0.0"
                     "metrics_port" .Values.trainer.metricsPort)
-}}
{{- if eq .Values.engine.kind "sglang" -}}
{{- $_ := set $mesh.engine "type" "sglang" -}}
{{- $_ := set $mesh.engine "tensor_parallel_size" .Values.engine.tensorParallelSize -}}
{{- $_ := set $mesh.engine "extra_args" .Values.engine.sglangArgs -}}
{{- end -}}
{{- if .Values.auth.tls.secretName -}}
{{- $dir := include "rollmesh.tlsDir" . -}}
{{- $_ := set $mesh "auth" (dict "tls" (dict "cert_path" (printf "%s/tls.crt" $dir) "key_path" (printf "%s/tls.key" $dir)
                                              "ca_path" (printf "%s/ca.crt" $dir))) -}}
{{- end -}}
{{- toYaml (mergeOverwrite (deepCopy .Values.config) $mesh) -}}
{{- end -}}

{{/* The data token, in every rollmesh container but the engines' (services/auth.py reads ROLLMESH_TOKEN). */}}
{{- define "rollmesh.tokenEnv" -}}
- name: ROLLMESH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.existingSecret | default (printf "%s-token" (include "rollmesh.fullname" .)) }}
      key: {{ .Values.auth.secretKey }}
{{- end -}}

{{/* The control token (weights, suspend/resume, commits, the engines' API): the engines, the LLMProxy,
the controller and the trainer only (ROLLMESH_CONTROL_TOKEN). */}}
{{- define "rollmesh.controlTokenEnv" -}}
- name: ROLLMESH_CONTROL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.existingSecret | default (printf "%s-token" (include "rollmesh.fullname" .)) }}
      key: {{ .Values.auth.controlSecretKey }}
{{- end -}}

{{/* Redis's password, for Redis itself and the SampleBuffer (sample_buffer/config.py reads
ROLLMESH_REDIS_PASSWORD; redis-cli, the probes', REDISCLI_AUTH). */}}
{{- define "rollmesh.redisPasswordEnv" -}}
{{- range $name := list "ROLLMESH_REDIS_PASSWORD" "REDISCLI_AUTH" }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.auth.existingSecret | default (printf "%s-token" (include "rollmesh.fullname" $)) }}
      key: {{ $.Values.redis.passwordKey }}
{{- end }}
{{- end -}}

{{/* Where the auth.tls Secret is mounted (not under /etc/rollmesh: that is the config's volume). */}}
{{- define "rollmesh.tlsDir" -}}/etc/rollmesh-tls{{- end -}}

{{/* Volumes and mounts of a rollmesh pod: the config, the model, the data, the TLS Secret when there
     is one, and the runs volume where "runs" says (the control role's pods only: the trainer's
     checkpoints and the controller's state are read back at resume, so no pod holding just the data
     token may write there). Call with (dict "root" $ "runs" true|false). */}}
{{- define "rollmesh.volumes" -}}
{{- $root := .root -}}
- name: config
  configMap:
    name: {{ include "rollmesh.fullname" $root }}-config
- name: model
  {{- toYaml $root.Values.model.volume | nindent 2 }}
- name: data
  {{- toYaml $root.Values.data.volume | nindent 2 }}
{{- if .runs }}
- name: runs
  persistentVolumeClaim:
    claimName: {{ $root.Values.runs.existingClaim | default (printf "%s-runs" (include "rollmesh.fullname" $root)) }}
{{- end }}
{{- if $root.Values.auth.tls.secretName }}
- name: tls
  secret:
    secretName: {{ $root.Values.auth.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "rollmesh.volumeMounts" -}}
{{- $root := .root -}}
- name: config
  mountPath: /etc/rollmesh
  readOnly: true
- name: model
  mountPath: {{ $root.Values.model.mountPath }}
  readOnly: true
- name: data
  mountPath: {{ $root.Values.data.mountPath }}
  readOnly: true
{{- if .runs }}
- name: runs
  mountPath: {{ $root.Values.runs.mountPath }}
{{- end }}
{{- if $root.Values.auth.tls.secretName }}
- name: tls
  mountPath: {{ include "rollmesh.tlsDir" $root }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A CPU gRPC service: Deployment + Service, health-probed over gRPC.
Call with (dict "root" $ "component" "llm-proxy" "serve" "llm-proxy" "values" .Values.proxy "replicas" 1).
*/}}
{{- define "rollmesh.grpcService" -}}
{{- $root := .root -}}
{{- $runs := has .component (list "llm-proxy" "controller") -}}
{{- $v := .values -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "rollmesh.fullname" $root }}-{{ .component }}
  labels:
    {{- include "rollmesh.labels" $ctx | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  selector:
    matchLabels:
      {{- include "rollmesh.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "rollmesh.selectorLabels" $ctx | nindent 8 }}
      annotations:
        checksum/config: {{ include "rollmesh.config" $root | sha256sum }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: 60
      containers:
        - name: {{ .component }}
          image: {{ include "rollmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["rollmesh", "serve", {{ .serve | quote }}, "--config", "/etc/rollmesh/config.yaml"]
          env:
            {{- include "rollmesh.tokenEnv" $root | nindent 12 }}
            {{- if has .component (list "llm-proxy" "controller") }}
            {{- include "rollmesh.controlTokenEnv" $root | nindent 12 }}
            {{- end }}
            {{- if eq .component "sample-buffer" }}
            {{- include "rollmesh.redisPasswordEnv" $root | nindent 12 }}
            {{- end }}
          ports:
            - {name: grpc, containerPort: {{ $v.port }}}
            - {name: metrics, containerPort: {{ $v.metricsPort }}}
          {{- $probe := ternary (dict "tcpSocket" (dict "port" "grpc")) (dict "grpc" (dict "port" $v.port)) (not (empty $root.Values.auth.tls.secretName)) }}
          readinessProbe:
            {{- toYaml $probe | nindent 12 }}
            periodSeconds: 5
          livenessProbe:
            {{- toYaml $probe | nindent 12 }}
            initialDelaySeconds: 60
            periodSeconds: 20
            failureThreshold: 6
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          volumeMounts:
            {{- include "rollmesh.volumeMounts" (dict "root" $root "runs" $runs) | nindent 12 }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumes:
        {{- include "rollmesh.volumes" (dict "root" $root "runs" $runs) | nindent 8 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ include "rollmesh.fullname" $root }}-{{ .component }}
  labels:
    {{- include "rollmesh.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "rollmesh.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $v.port }}, targetPort: grpc}
    - {name: metrics, port: {{ $v.metricsPort }}, targetPort: metrics}
{{- end -}}
