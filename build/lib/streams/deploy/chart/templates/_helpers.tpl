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

{{/* Where every Tangram container reaches Kafka, the registry, Redis (password by reference) and Triton. */}}
{{- define "tangram.env" -}}
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
