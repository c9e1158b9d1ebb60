{{/* Labels every resource of the release carries. */}}
{{- define "tangram.labels" -}}
app.kubernetes.io/name: tangram
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ .Values.app.name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tangram.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/* Where every Tangram container reaches Kafka and the registry: all a gateway needs.
     A container's identity (its Kafka principal, its registry user) comes from "tangram.identity". */}}
{{- define "tangram.kafkaEnv" -}}
- name: TANGRAM_HOST
  value: "0.0.0.0"
- name: TANGRAM_KAFKA_HOST
  value: {{ .Values.kafka.host | quote }}
- name: TANGRAM_KAFKA_PORT
  value: {{ .Values.kafka.port | quote }}
- name: TANGRAM_REGISTRY_HOST
  value: {{ printf "%s-schema-registry" .Release.Name }}
- name: TANGRAM_REGISTRY_PORT
  value: "8081"
{{- end }}

{{/* A processor's: "tangram.kafkaEnv", and Redis (password by reference) and Triton. */}}
{{- define "tangram.env" -}}
{{ include "tangram.kafkaEnv" . }}
- name: TANGRAM_REDIS_HOST
  value: {{ printf "%s-redis" .Release.Name }}
- name: TANGRAM_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.secretKey }}
- name: TANGRAM_TRITON_HOST
  value: {{ printf "%s-triton" .Release.Name }}
{{- end }}

{{/* A container's Kafka principal and registry user, every password by reference:
     (dict "root" $ "principal" NAME "registry" "reader"|"admin"). Mount "tangram.caVolume" beside it. */}}
{{- define "tangram.identity" -}}
{{- $root := .root }}
{{- if $root.Values.kafka.security.enabled }}
- name: TANGRAM_KAFKA_SECURITY__PROTOCOL
  value: SASL_SSL
- name: TANGRAM_KAFKA_SECURITY__MECHANISM
  value: {{ $root.Values.kafka.security.mechanism | quote }}
- name: TANGRAM_KAFKA_SECURITY__USERNAME
  value: {{ .principal | quote }}
- name: TANGRAM_KAFKA_SECURITY__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .principal }}
      key: password
- name: TANGRAM_KAFKA_SECURITY__CA_FILE
  value: {{ printf "/etc/tangram/kafka-ca/%s" $root.Values.kafka.security.caKey | quote }}
{{- end }}
{{- $user := index $root.Values.schemaRegistry .registry }}
- name: TANGRAM_REGISTRY_USERNAME
  value: {{ $user.user | quote }}
- name: TANGRAM_REGISTRY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $user.secret }}
      key: {{ $user.key }}
{{- end }}

{{/* The cluster CA every Kafka client trusts (Strimzi's Secret), as a volume and its mount. */}}
{{- define "tangram.caVolume" -}}
{{- if .Values.kafka.security.enabled }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.security.caSecret }}
{{- end }}
{{- end }}

{{- define "tangram.caMount" -}}
{{- if .Values.kafka.security.enabled }}
- name: kafka-ca
  mountPath: /etc/tangram/kafka-ca
  readOnly: true
{{- end }}
{{- end }}

{{/* The payload store (streams.payloads), one claim every writer and reader of references mounts where the
     image's TANGRAM_HOME puts the app's `payloads.store`: "payloads.yaml" makes it unless one is brought. */}}
{{- define "tangram.payloadVolume" -}}
- name: payloads
  persistentVolumeClaim:
    claimName: {{ .Values.payloads.existingClaim | default (printf "%s-payloads" .Release.Name) }}
{{- end }}

{{- define "tangram.payloadMount" -}}
- name: payloads
  mountPath: {{ .Values.payloads.mountPath }}
{{- end }}

{{/* A Prometheus Operator ServiceMonitor on a Service's `metrics` port, if serviceMonitor.enabled:
     (dict "root" $ "name" NAME "selector" LABELS). */}}
{{- define "tangram.serviceMonitor" -}}
{{- $root := .root }}
{{- if $root.Values.serviceMonitor.enabled }}
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ .name }}
  labels:
    {{- include "tangram.labels" $root | nindent 4 }}
    {{- with $root.Values.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/instance: {{ $root.Release.Name }}
      {{- toYaml .selector | nindent 6 }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $root.Values.serviceMonitor.interval }}
{{- end }}
{{- end }}

{{/* The fewest partitions among a processor's inputs: the most consumer-group members that get work. */}}
{{- define "tangram.partitionBound" -}}
{{- $root := index . 0 }}{{- $p := index . 1 }}
{{- $bound := 0 }}
{{- range $p.inputs }}
{{- $n := int (index $root.Values.topics .).partitions }}
{{- if or (eq $bound 0) (lt $n $bound) }}{{- $bound = $n }}{{- end }}
{{- end }}
{{- $bound }}
{{- end }}
